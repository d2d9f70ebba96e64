// What the proxy suites share: fake engines and proxies stopped after the file's
// tests, the openai client, raw HTTP requests, and Prometheus samples.
import { after } from 'node:test';
import OpenAI from 'openai';
import { startFakeEngine, startProxy } from './fake_engines.mjs';

// Registers the clean-up hook of the calling test file; `cleanups` runs last first,
// every one of them even when one fails (no process is left behind).
export function useFixtures() {
  const cleanups = [];
  after(async () => {
    const failures = [];
    for (const fn of cleanups.reverse()) await fn().catch((err) => failures.push(err));
    if (failures.length > 0) throw failures[0];
  });
  return {
    cleanups,
    // One fake engine per role named, named <role><n>.
    async engines(...roles) {
      const list = [];
      for (const role of roles) {
        const e = await startFakeEngine(role, `${role}${list.filter((x) => x.role === role).length}`);
        cleanups.push(() => e.close());
        list.push(e);
      }
      return list;
    },
    async proxy(args, env) {
      const p = await startProxy(args, env);
      cleanups.push(() => p.stop());
      return p;
    },
  };
}

export function client(p) {
  // maxRetries 0: the proxy's own retry is under test, not the client's.
  return new OpenAI({ baseURL: `${p.url}/v1`, apiKey: 'test-key', maxRetries: 0, timeout: 20_000 });
}

export const image = (url) => ({ type: 'image_url', image_url: { url } });

export async function rawRequest(url, { method = 'GET', headers = {}, body } = {}) {
  let res;
  try {
    res = await fetch(url, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (err) {
    throw new Error(`${method} ${url}: ${err.cause?.message ?? err.message}`);
  }
  const text = await res.text();
  let json = null;
  try {
    json = JSON.parse(text);
  } catch {}
  return { status: res.status, text, json, headers: res.headers };
}

// The value of one sample in Prometheus text (`series` as rendered, labels included);
// undefined when absent.
export function sample(text, series) {
  for (const line of text.split('\n')) {
    if (line.startsWith(`${series} `)) return Number(line.slice(series.length + 1));
  }
  return undefined;
}
