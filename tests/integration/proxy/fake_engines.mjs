// Test doubles for `ecx proxy`: fake OpenAI-compatible engines for the encode,
// prefill and decode roles. They run no model; they record every request they
// receive and answer the way vLLM's OpenAI server does (JSON or SSE streams), with
// knobs to fail, stall a stream, or return broken metadata.
import http from 'node:http';
import crypto from 'node:crypto';
import { spawn } from 'node:child_process';
import { once } from 'node:events';

export const sha256 = (text) => crypto.createHash('sha256').update(text).digest('hex');

// The identifier a real engine derives from an item's uuid and the request's kwargs:
// deliberately different from the proxy's content id.
export const engineHash = (uuid, body) =>
  'eh-' + sha256(`${uuid}|${JSON.stringify(body.mm_processor_kwargs ?? {})}`).slice(0, 24);

const MEDIA_TYPES = new Set(['image_url', 'audio_url', 'input_audio', 'video_url']);

function mediaItems(body) {
  const items = [];
  for (const message of body.messages ?? []) {
    if (!Array.isArray(message.content)) continue;
    for (const part of message.content) if (MEDIA_TYPES.has(part.type)) items.push(part);
  }
  return items;
}

function readBody(req) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => resolve(Buffer.concat(chunks).toString('utf8')));
    req.on('error', reject);
  });
}

function sendJson(res, status, value) {
  const text = JSON.stringify(value);
  res.writeHead(status, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(text) });
  res.end(text);
}

// role: 'encode' | 'prefill' | 'decode'.
export async function startFakeEngine(role, name = role) {
  const engine = {
    role,
    name,
    received: [],          // {method, path, headers, body}
    sentStreams: [],       // the exact SSE bytes of each streamed answer
    healthy: true,
    failNext: [],          // statuses to answer the next chat/completion requests with
    encoderMode: 'keyed',  // keyed | list | garbage | none
    tokens: ['Hello', ' from', ' the', ' fake', ' decode', '.'],
    streamGate: null,      // a promise the stream waits on after its first event
    url: '',
    chats() {
      return this.received.filter((r) => r.path === '/v1/chat/completions');
    },
  };

  const answerEncoder = (res, body) => {
    const items = mediaItems(body);
    const bindings = body.ec_transfer_params?.ec_items ?? [];
    const answer = { id: `cmpl-${name}`, object: 'chat.completion', model: body.model, choices: [] };
    if (engine.encoderMode === 'garbage') {
      answer.ec_transfer_params = 'not-an-object';
    } else if (engine.encoderMode === 'list') {
      answer.ec_transfer_params = {
        ec_items: items.map((item, i) => ({
          mm_hash: engineHash(item.uuid ?? '', body),
          image_grid_thw: [[1, 8 + i, 8]],
          transfer_id: bindings[i]?.transfer_id,
        })),
      };
    } else if (engine.encoderMode === 'keyed') {
      const params = {};
      items.forEach((item, i) => {
        const hash = engineHash(item.uuid ?? sha256(JSON.stringify(item)), body);
        params[hash] = { metadata: { image_grid_thw: [[1, 16, 16]] }, item_indices: [i], producer: name };
      });
      params.ec_items = items.map((item, i) => ({
        mm_hash: engineHash(item.uuid ?? sha256(JSON.stringify(item)), body),
        transfer_id: bindings[i]?.transfer_id,
      }));
      answer.ec_transfer_params = params;
    }
    sendJson(res, 200, answer);
  };

  const answerPrefill = (res, body, headers) => {
    sendJson(res, 200, {
      id: `cmpl-${name}`,
      object: 'chat.completion',
      choices: [{ index: 0, message: { role: 'assistant', content: 'x' }, finish_reason: 'length' }],
      kv_transfer_params: {
        do_remote_prefill: true,
        do_remote_decode: false,
        remote_engine_id: `${name}-engine`,
        remote_block_ids: [3, 1, 4],
        remote_host: '127.0.0.1',
        remote_port: 5557,
        request: headers['x-request-id'],
      },
    });
  };

  const answerDecode = async (req, res, body, completions) => {
    const text = engine.tokens.join('');
    if (!body.stream) {
      sendJson(res, 200, completions
        ? { id: 'cmpl-1', object: 'text_completion', choices: [{ index: 0, text, finish_reason: 'stop' }] }
        : {
            id: 'chatcmpl-1',
            object: 'chat.completion',
            created: 1,
            model: body.model,
            choices: [{ index: 0, message: { role: 'assistant', content: text }, finish_reason: 'stop' }],
            usage: { prompt_tokens: 3, completion_tokens: engine.tokens.length, total_tokens: 3 + engine.tokens.length },
          });
      return;
    }
    res.writeHead(200, { 'Content-Type': 'text/event-stream; charset=utf-8', 'Cache-Control': 'no-cache' });
    const sent = [];
    const write = (data) => {
      sent.push(data);
      res.write(data);
    };
    for (let i = 0; i < engine.tokens.length; ++i) {
      const event = completions
        ? { id: 'cmpl-1', object: 'text_completion', choices: [{ index: 0, text: engine.tokens[i] }] }
        : {
            id: 'chatcmpl-1',
            object: 'chat.completion.chunk',
            created: 1,
            model: body.model,
            choices: [{ index: 0, delta: { content: engine.tokens[i] }, finish_reason: null }],
          };
      write(`data: ${JSON.stringify(event)}\n\n`);
      if (i === 0 && engine.streamGate) await engine.streamGate;
    }
    write('data: [DONE]\n\n');
    engine.sentStreams.push(sent.join(''));
    res.end();
  };

  const server = http.createServer(async (req, res) => {
    const raw = await readBody(req);
    const path = req.url.split('?')[0];
    let body = null;
    try {
      body = raw ? JSON.parse(raw) : null;
    } catch {
      body = raw;
    }
    if (path !== '/health') engine.received.push({ method: req.method, path, headers: req.headers, body });
    if (path === '/health') {
      res.writeHead(engine.healthy ? 200 : 503).end();
      return;
    }
    if (path === '/v1/models') {
      sendJson(res, 200, { object: 'list', data: [{ id: 'fake-model', object: 'model', owned_by: name }] });
      return;
    }
    if (path !== '/v1/chat/completions' && path !== '/v1/completions') {
      sendJson(res, 404, { error: { message: `no route ${path}`, type: 'NotFoundError', code: 404 } });
      return;
    }
    if (engine.failNext.length > 0) {
      const status = engine.failNext.shift();
      sendJson(res, status, { error: { message: `${name} failed on purpose`, type: 'InternalServerError', code: status } });
      return;
    }
    if (role === 'encode') answerEncoder(res, body);
    else if (role === 'prefill') answerPrefill(res, body, req.headers);
    else await answerDecode(req, res, body, path === '/v1/completions');
  });
  server.keepAliveTimeout = 10_000;
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  engine.url = `http://127.0.0.1:${server.address().port}`;
  engine.close = async () => {
    server.closeAllConnections();
    server.close();
    await once(server, 'close');
  };
  return engine;
}

// A free TCP port that nothing listens on (connections are refused).
export async function closedPort() {
  const server = http.createServer();
  server.listen(0, '127.0.0.1');
  await once(server, 'listening');
  const { port } = server.address();
  server.close();
  await once(server, 'close');
  return port;
}

// Starts `ecx proxy` on a free loopback port; resolves once it listens.
export async function startProxy(args, env = {}) {
  const binary = process.env.ECX_BIN;
  if (!binary) throw new Error('ECX_BIN must name the ecx binary');
  const child = spawn(binary, ['proxy', '--host', '127.0.0.1', '--port', '0', ...args], {
    env: { ...process.env, ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let stderr = '';
  child.stderr.on('data', (d) => (stderr += d));
  const port = await new Promise((resolve, reject) => {
    let out = '';
    const timer = setTimeout(() => reject(new Error(`ecx proxy did not start: ${stderr}`)), 10_000);
    child.stdout.on('data', (d) => {
      out += d;
      const m = out.match(/listening on http:\/\/[^:]+:(\d+)/);
      if (m) {
        clearTimeout(timer);
        resolve(Number(m[1]));
      }
    });
    child.on('close', (code) => {  // after its output is read whole
      clearTimeout(timer);
      reject(new Error(`ecx proxy exited with ${code}: ${stderr}`));
    });
  });
  const exited = new Promise((resolve) => child.on('exit', (code, signal) => resolve({ code, signal })));
  return {
    url: `http://127.0.0.1:${port}`,
    port,
    child,
    exited,
    stderr: () => stderr,
    async stop() {
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGTERM');
      return exited;
    },
  };
}

// Polls `check` until it returns a truthy value; fails after `ms`. The bound is a
// failure's wait, not a pass's: generous, so that a 2-CPU machine running other
// tests beside this one does not turn slowness into a failure (seen at 5 s).
export async function eventually(check, ms = 20000, what = 'condition') {
  const deadline = Date.now() + ms;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}
