// A real redis-server (Debian package) on a free loopback port, and a minimal RESP
// client over node:net for the tests to write and delete store keys themselves.
import net from 'node:net';
import os from 'node:os';
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { closedPort, eventually } from './fake_engines.mjs';

// One RESP reply from the start of `buf`: [value, bytes used], or null when incomplete.
function parseReply(buf, at = 0) {
  const end = buf.indexOf('\r\n', at);
  if (end < 0) return null;
  const line = buf.toString('utf8', at + 1, end);
  const next = end + 2;
  switch (String.fromCharCode(buf[at])) {
    case '+': return [line, next];
    case '-': return [new Error(line), next];
    case ':': return [Number(line), next];
    case '$': {
      const length = Number(line);
      if (length < 0) return [null, next];
      if (buf.length < next + length + 2) return null;
      return [buf.toString('utf8', next, next + length), next + length + 2];
    }
    case '*': {
      const count = Number(line);
      const items = [];
      let pos = next;
      for (let i = 0; i < count; ++i) {
        const item = parseReply(buf, pos);
        if (!item) return null;
        items.push(item[0]);
        pos = item[1];
      }
      return [items, pos];
    }
    default: throw new Error(`unexpected RESP reply ${JSON.stringify(line)}`);
  }
}

// Sends one command on a fresh connection and resolves with its reply (rejects on a
// Redis error or after `ms`).
export function redisCommand(port, args, ms = 5000) {
  return new Promise((resolve, reject) => {
    const socket = net.connect({ host: '127.0.0.1', port });
    let buf = Buffer.alloc(0);
    const timer = setTimeout(() => socket.destroy(new Error(`redis ${args[0]} timed out`)), ms);
    const finish = (fn, value) => {
      clearTimeout(timer);
      socket.destroy();
      fn(value);
    };
    socket.on('error', (err) => finish(reject, err));
    socket.on('data', (chunk) => {
      buf = Buffer.concat([buf, chunk]);
      const reply = parseReply(buf);
      if (reply) finish(reply[0] instanceof Error ? reject : resolve, reply[0]);
    });
    const parts = args.map(String);
    socket.write(`*${parts.length}\r\n` + parts.map((a) => `$${Buffer.byteLength(a)}\r\n${a}\r\n`).join(''));
  });
}

// Starts redis-server with the keyspace notifications the presence index needs.
export async function startRedis() {
  for (let attempt = 0; ; ++attempt) {
    const port = await closedPort();  // may be taken again meanwhile: then try another
    const child = spawn(process.env.ECX_REDIS_SERVER || 'redis-server', [
      '--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', '--daemonize', 'no',
      '--loglevel', 'warning', '--dir', os.tmpdir(), '--notify-keyspace-events', 'K$gxe',
    ], { stdio: ['ignore', 'pipe', 'pipe'] });
    let output = '';
    child.stdout.on('data', (d) => (output += d));
    child.stderr.on('data', (d) => (output += d));
    const exited = new Promise((resolve) => child.on('exit', (code, signal) => resolve({ code, signal })));
    let gone = false;
    exited.then(() => (gone = true));
    try {
      await eventually(async () => gone || (await redisCommand(port, ['PING'], 500).catch(() => null)) === 'PONG',
                       10_000, 'redis-server to answer PING');
    } catch (err) {
      child.kill('SIGKILL');
      throw err;
    }
    if (gone) {
      if (attempt < 3) continue;
      throw new Error(`redis-server did not start: ${output}`);
    }
    return {
      port,
      url: `redis://127.0.0.1:${port}/0`,
      command: (args) => redisCommand(port, args),
      async kill() {
        if (!gone) child.kill('SIGKILL');
        await exited;
      },
    };
  }
}
