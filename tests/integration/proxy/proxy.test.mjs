// Integration tests of `ecx proxy`: the real binary between the official `openai`
// client and fake engines (fake_engines.mjs), all on 127.0.0.1.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';
import { closedPort, eventually, sha256, engineHash } from './fake_engines.mjs';
import { useFixtures, client, image, rawRequest } from './harness.mjs';

const HEX32 = /^[0-9a-f]{32}$/;
const { engines, proxy } = useFixtures();

const IMG_A = 'https://example.invalid/a.png';
const IMG_B = 'https://example.invalid/b.png';

function chatWithImages(extra = {}) {
  return {
    model: 'fake-model',
    messages: [
      { role: 'system', content: 'Answer briefly.' },
      { role: 'user', content: [{ type: 'text', text: 'Compare these.' }, image(IMG_A), image(IMG_B)] },
      { role: 'user', content: [image(IMG_A), { type: 'text', text: 'And this one again?' }] },
    ],
    ...extra,
  };
}

function encoderCalls(encoders) {
  return encoders.flatMap((e) => e.chats().map((r) => ({ ...r, engine: e.name })));
}

test('E+PD, non-streaming: every image occurrence is encoded and bound with the same transfer id on both hops', async () => {
  const [e0, e1, d] = await engines('encode', 'encode', 'decode');
  const p = await proxy([
    '--encode', `${e0.url},${e1.url}`, '--decode', d.url,
    '--ec-consumer-zmq-addrs', 'tcp://127.0.0.1:15000,tcp://127.0.0.1:15001', '--ec-consumer-dp-size', '2',
    '--probe-interval', '0',
  ]);
  const openai = client(p);
  const answer = await openai.chat.completions.create(chatWithImages({ mm_processor_kwargs: { max_pixels: 4096 } }),
                                                      { headers: { 'x-request-id': 'parent-1' } });
  assert.equal(answer.choices[0].message.content, 'Hello from the fake decode.');

  // Encoders: one sub-request per occurrence, round robin, each naming its consumer.
  const calls = encoderCalls([e0, e1]);
  assert.equal(calls.length, 3);
  assert.ok(e0.chats().length >= 1 && e1.chats().length >= 1, 'both encoders used');
  const byIndex = new Map();
  for (const call of calls) {
    const m = call.headers['x-request-id'].match(/^parent-1:(\d+):([0-9a-f]{6})$/);
    assert.ok(m, `encoder request id ${call.headers['x-request-id']}`);
    byIndex.set(Number(m[1]), call);
    assert.equal(call.body.stream, false);
    assert.equal(call.body.max_tokens, 1);
    assert.deepEqual(call.body.mm_processor_kwargs, { max_pixels: 4096 });
    assert.equal(call.body.messages.length, 1);
    assert.equal(call.body.messages[0].content.length, 1);
    assert.equal(call.body.ec_transfer_params.consumer_zmq, 'tcp://127.0.0.1:15000');  // replica 0 of 2
    assert.equal(call.body.ec_transfer_params.ec_items.length, 1);
    assert.match(call.body.ec_transfer_params.ec_items[0].transfer_id, HEX32);
    assert.equal(call.body.ec_transfer_params.ec_items[0].mm_hash, undefined);
    assert.equal(call.headers.authorization, 'Bearer test-key');
  }
  assert.deepEqual([...byIndex.keys()].sort(), [0, 1, 2]);
  const items = [0, 1, 2].map((i) => byIndex.get(i).body.messages[0].content[0]);
  assert.deepEqual(items.map((it) => it.image_url.url), [IMG_A, IMG_B, IMG_A]);
  assert.deepEqual(items.map((it) => it.uuid), [sha256(IMG_A), sha256(IMG_B), sha256(IMG_A)]);
  const ids = [0, 1, 2].map((i) => byIndex.get(i).body.ec_transfer_params.ec_items[0].transfer_id);
  assert.equal(new Set(ids).size, 3, 'a fresh transfer id per occurrence, repeated image included');

  // Decode: the same ids, in item order, with the engine hashes the encoders reported.
  const [decodeCall] = d.chats();
  assert.equal(d.chats().length, 1);
  assert.equal(decodeCall.headers['x-request-id'], 'parent-1');
  assert.equal(decodeCall.headers['x-data-parallel-rank'], '0');
  const params = decodeCall.body.ec_transfer_params;
  const kwargs = { mm_processor_kwargs: { max_pixels: 4096 } };
  assert.deepEqual(params.ec_items, [
    { mm_hash: engineHash(sha256(IMG_A), kwargs), transfer_id: ids[0] },
    { mm_hash: engineHash(sha256(IMG_B), kwargs), transfer_id: ids[1] },
    { mm_hash: engineHash(sha256(IMG_A), kwargs), transfer_id: ids[2] },
  ]);
  assert.equal(params[engineHash(sha256(IMG_B), kwargs)].item_indices, undefined);
  assert.ok(params[engineHash(sha256(IMG_B), kwargs)].producer.startsWith('encode'));
  const parts = decodeCall.body.messages[1].content;
  assert.deepEqual(parts[0], { type: 'text', text: 'Compare these.' });
  assert.deepEqual(parts[1], { type: 'image_embeds', image_embeds: { image_grid_thw: [[1, 16, 16]] }, uuid: sha256(IMG_A) });
  assert.equal(decodeCall.body.messages[2].content[0].type, 'image_embeds');
  assert.equal(decodeCall.body.messages[0].content, 'Answer briefly.');

  // The next request goes to the consumer's other DP replica.
  await openai.chat.completions.create(chatWithImages());
  const second = d.chats()[1];
  assert.equal(second.headers['x-data-parallel-rank'], '1');
  assert.match(second.headers['x-request-id'], HEX32);
  const secondEncodes = encoderCalls([e0, e1]).filter((c) => c.headers['x-request-id'].startsWith(second.headers['x-request-id']));
  assert.equal(secondEncodes.length, 3);
  for (const c of secondEncodes) assert.equal(c.body.ec_transfer_params.consumer_zmq, 'tcp://127.0.0.1:15001');
});

test('E+PD, streaming: SSE arrives incrementally and byte for byte', async () => {
  const [e, d] = await engines('encode', 'decode');
  const p = await proxy(['--encode', e.url, '--decode', d.url, '--ec-consumer-zmq-addrs', 'tcp://127.0.0.1:15010',
                         '--probe-interval', '0']);
  const openai = client(p);
  // The decode holds its stream after the first event until the client has seen that event:
  // a proxy that buffered the stream would never let the client see it, and the test would time out.
  let release;
  d.streamGate = new Promise((r) => (release = r));
  const stream = await openai.chat.completions.create(chatWithImages({ stream: true, stream_options: { include_usage: false } }));
  let text = '';
  let events = 0;
  for await (const chunk of stream) {
    text += chunk.choices[0]?.delta?.content ?? '';
    if (++events === 1) {
      assert.equal(d.sentStreams.length, 0, 'first event reached the client while the decode still holds the rest');
      release();
    }
  }
  assert.equal(text, 'Hello from the fake decode.');
  assert.equal(events, 6);
  d.streamGate = null;

  // Raw bytes: exactly what the decode sent, including multi-byte characters.
  d.tokens = ['Grüße', ' 🙂', ' end'];
  const res = await rawRequest(`${p.url}/v1/chat/completions`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' }, body: chatWithImages({ stream: true }),
  });
  assert.equal(res.status, 200);
  assert.match(res.headers.get('content-type'), /^text\/event-stream/);
  assert.equal(res.text, d.sentStreams.at(-1));
  assert.ok(res.text.endsWith('data: [DONE]\n\n'));
});

test('E+P+D: the prefill hop gets kv_transfer_params and the DP rank, the decode gets what the prefill returned', async () => {
  const [e, pf, d] = await engines('encode', 'prefill', 'decode');
  const p = await proxy([
    '--encode', e.url, '--prefill', pf.url, '--decode', d.url,
    '--ec-consumer-zmq-addrs', 'tcp://127.0.0.1:15020,tcp://127.0.0.1:15021', '--ec-consumer-dp-size', '2',
    '--probe-interval', '0',
  ]);
  const openai = client(p);
  const stream = await openai.chat.completions.create(
    chatWithImages({ stream: true, stream_options: { include_usage: true }, max_completion_tokens: 50 }),
    { headers: { 'x-request-id': 'epd-1' } });
  let text = '';
  for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? '';
  assert.equal(text, 'Hello from the fake decode.');

  const encodes = e.chats();
  assert.equal(encodes.length, 3);
  for (const c of encodes) assert.equal(c.body.ec_transfer_params.consumer_zmq, 'tcp://127.0.0.1:15020');
  const ids = encodes
    .sort((a, b) => Number(a.headers['x-request-id'].split(':')[1]) - Number(b.headers['x-request-id'].split(':')[1]))
    .map((c) => c.body.ec_transfer_params.ec_items[0].transfer_id);

  const [prefillCall] = pf.chats();
  assert.equal(prefillCall.headers['x-data-parallel-rank'], '0');
  assert.equal(prefillCall.headers['x-request-id'], 'epd-1');
  assert.equal(prefillCall.body.stream, false);
  assert.equal(prefillCall.body.max_tokens, 1);
  assert.equal(prefillCall.body.max_completion_tokens, 1);
  assert.equal(prefillCall.body.stream_options, undefined);
  assert.deepEqual(prefillCall.body.kv_transfer_params, {
    do_remote_decode: true, do_remote_prefill: false, remote_engine_id: null, remote_block_ids: null,
    remote_host: null, remote_port: null,
  });
  assert.deepEqual(prefillCall.body.ec_transfer_params.ec_items.map((i) => i.transfer_id), ids);

  const [decodeCall] = d.chats();
  assert.equal(decodeCall.headers['x-data-parallel-rank'], undefined, 'the DP rank goes to the consumer stage only');
  assert.equal(decodeCall.body.stream, true);
  assert.equal(decodeCall.body.max_completion_tokens, 50);
  assert.deepEqual(decodeCall.body.stream_options, { include_usage: true });
  assert.equal(decodeCall.body.kv_transfer_params.remote_engine_id, 'prefill0-engine');
  assert.deepEqual(decodeCall.body.kv_transfer_params.remote_block_ids, [3, 1, 4]);
  assert.deepEqual(decodeCall.body.ec_transfer_params.ec_items.map((i) => i.transfer_id), ids);
});

test('a decode 500 re-runs the whole path with fresh transfer ids; a second 500 is passed through', async () => {
  const [e, d] = await engines('encode', 'decode');
  const p = await proxy(['--encode', e.url, '--decode', d.url, '--ec-consumer-zmq-addrs', 'tcp://127.0.0.1:15030',
                         '--probe-interval', '0']);
  const openai = client(p);
  d.failNext = [500];
  const answer = await openai.chat.completions.create(chatWithImages());
  assert.equal(answer.choices[0].message.content, 'Hello from the fake decode.');
  assert.equal(e.chats().length, 6, 'every image re-encoded');
  assert.equal(d.chats().length, 2);
  const first = d.chats()[0].body.ec_transfer_params.ec_items.map((i) => i.transfer_id);
  const second = d.chats()[1].body.ec_transfer_params.ec_items.map((i) => i.transfer_id);
  assert.equal(new Set([...first, ...second]).size, 6, 'a retry names fresh transfers');
  // The body sent on the retry is built from the client's, untouched by the first attempt.
  assert.deepEqual(d.chats()[1].body.messages.map((m) => m.role), ['system', 'user', 'user']);
  assert.equal(d.chats()[1].body.messages[1].content.length, 3);

  d.failNext = [500, 500];
  const err = await openai.chat.completions.create({ ...chatWithImages(), stream: true }).catch((x) => x);
  assert.equal(err.status, 500);
  assert.equal(err.error.stage, 'decode');
  assert.equal(err.error.upstream_error.error.message, 'decode0 failed on purpose');
  assert.equal(d.chats().length, 4);

  const metrics = await rawRequest(`${p.url}/metrics`);
  assert.match(metrics.text, /^ecx_proxy_retries_total 2$/m);
});

test('503 when a needed role has none live, 502 for encoder transport errors and bad metadata, statuses passed through', async () => {
  const [e, d, pf] = await engines('encode', 'decode', 'prefill');
  const dead = `http://127.0.0.1:${await closedPort()}`;

  const noEncoder = await proxy(['--decode', d.url, '--probe-interval', '0']);
  let r = await rawRequest(`${noEncoder.url}/v1/chat/completions`, { method: 'POST', body: chatWithImages() });
  assert.equal(r.status, 503);
  assert.equal(r.json.error.stage, 'encode');
  r = await rawRequest(`${noEncoder.url}/v1/chat/completions`, {
    method: 'POST', body: { model: 'm', messages: [{ role: 'user', content: 'text only' }] },
  });
  assert.equal(r.status, 200, 'a text-only request needs no encoder');

  const noDecode = await proxy(['--encode', e.url, '--probe-interval', '0']);
  r = await rawRequest(`${noDecode.url}/v1/chat/completions`, { method: 'POST', body: chatWithImages() });
  assert.equal(r.status, 503);
  assert.equal(r.json.error.stage, 'decode');
  assert.equal((await rawRequest(`${noDecode.url}/v1/models`)).status, 503);

  const deadEncoder = await proxy(['--encode', dead, '--decode', d.url, '--probe-interval', '0']);
  const before = d.chats().length;
  r = await rawRequest(`${deadEncoder.url}/v1/chat/completions`, { method: 'POST', body: chatWithImages() });
  assert.equal(r.status, 502);
  assert.equal(r.json.error.stage, 'encode');
  assert.match(r.json.error.message, /connect/);
  assert.equal(d.chats().length, before, 'nothing reaches the decode after a failed encode');

  const p = await proxy(['--encode', e.url, '--decode', d.url, '--probe-interval', '0', '--max-body-bytes', '4096']);
  // One image per failing request: a fail-fast answer cancels sibling sub-requests,
  // which could otherwise still reach the fake encoder and eat the next knob.
  const oneImage = { model: 'fake-model', messages: [{ role: 'user', content: [image(IMG_B)] }] };
  e.encoderMode = 'garbage';
  r = await rawRequest(`${p.url}/v1/chat/completions`, { method: 'POST', body: oneImage });
  assert.equal(r.status, 502);
  assert.equal(r.json.error.stage, 'encode');
  assert.match(r.json.error.message, /unusable metadata/);

  e.encoderMode = 'keyed';
  e.failNext = [400];
  r = await rawRequest(`${p.url}/v1/chat/completions`, { method: 'POST', body: oneImage });
  assert.equal(r.status, 400);
  assert.equal(r.json.error.stage, 'encode');
  assert.equal(r.json.error.upstream_error.error.message, 'encode0 failed on purpose');

  d.failNext = [404];
  r = await rawRequest(`${p.url}/v1/chat/completions`, { method: 'POST', body: chatWithImages() });
  assert.equal(r.status, 404);
  assert.equal(r.json.error.stage, 'decode');

  // No metadata from the encoder: the media goes raw (with its uuid), the bindings still go.
  e.encoderMode = 'none';
  r = await rawRequest(`${p.url}/v1/chat/completions`, { method: 'POST', body: chatWithImages() });
  assert.equal(r.status, 200);
  const raw = d.chats().at(-1).body;
  assert.deepEqual(raw.messages[1].content[1], { ...image(IMG_A), uuid: sha256(IMG_A) });
  e.encoderMode = 'keyed';

  r = await rawRequest(`${p.url}/v1/chat/completions`, {
    method: 'POST', body: { model: 'm', messages: [{ role: 'user', content: 'x'.repeat(5000) }] },
  });
  assert.equal(r.status, 413);
  r = await rawRequest(`${p.url}/v1/chat/completions`, { method: 'POST', body: ['not', 'an', 'object'] });
  assert.equal(r.status, 400);
  assert.equal(r.json.error.stage, 'request');
  assert.equal((await rawRequest(`${p.url}/nowhere`)).status, 404);

  const epd = await proxy(['--encode', e.url, '--prefill', pf.url, '--decode', d.url, '--probe-interval', '0']);
  pf.failNext = [500];
  r = await rawRequest(`${epd.url}/v1/chat/completions`, { method: 'POST', body: chatWithImages() });
  assert.equal(r.status, 500);
  assert.equal(r.json.error.stage, 'prefill');
});

test('models, completions pass-through, health and Prometheus metrics', async () => {
  const [e, d] = await engines('encode', 'decode');
  const p = await proxy(['--encode', e.url, '--decode', d.url, '--probe-interval', '0']);
  const openai = client(p);
  const models = await openai.models.list();
  assert.equal(models.data[0].id, 'fake-model');

  const completion = await openai.completions.create({ model: 'fake-model', prompt: 'Hi', stream: true });
  let text = '';
  for await (const chunk of completion) text += chunk.choices[0].text;
  assert.equal(text, 'Hello from the fake decode.');
  const passed = d.received.filter((r) => r.path === '/v1/completions');
  assert.equal(passed.length, 1);
  assert.equal(passed[0].body.prompt, 'Hi');
  assert.equal(e.chats().length, 0);

  await openai.chat.completions.create(chatWithImages());
  const health = await rawRequest(`${p.url}/health`);
  assert.equal(health.status, 200);
  assert.deepEqual(health.json.instances.decode, { live: 1, evicted: 0 });

  const metrics = await rawRequest(`${p.url}/metrics`);
  assert.match(metrics.headers.get('content-type'), /^text\/plain/);
  assert.match(metrics.text, /^ecx_proxy_requests_total\{route="\/v1\/chat\/completions",status="200"\} 1$/m);
  assert.match(metrics.text, /^ecx_proxy_upstream_requests_total\{stage="encode",outcome="ok"\} 3$/m);
  assert.match(metrics.text, /^ecx_proxy_media_items_total\{modality="image"\} 3$/m);
  assert.match(metrics.text, /^ecx_proxy_stage_seconds_count\{stage="encode"\} 1$/m);
  assert.match(metrics.text, /^ecx_proxy_stage_seconds_bucket\{stage="total",le="\+Inf"\} 2$/m);
  assert.match(metrics.text, /^ecx_proxy_instances\{role="decode",state="live"\} 1$/m);
  assert.match(metrics.text, /^# TYPE ecx_proxy_stage_seconds histogram$/m);
});

test('admin API: key check, registration, liveness eviction, re-admission, forgetting, removal', async () => {
  const [e, d] = await engines('encode', 'decode');
  const key = 'admin-secret';
  const p = await proxy(['--probe-interval', '0.05', '--probe-timeout', '0.5', '--fail-threshold', '3',
                         '--evicted-ttl', '0.5'], { ECX_PROXY_ADMIN_KEY: key });
  const admin = (method, body, k = key) =>
    rawRequest(`${p.url}/instances`, { method, headers: { 'X-API-Key': k, 'Content-Type': 'application/json' }, body });

  assert.equal((await admin('GET', undefined, 'wrong')).status, 401);
  assert.equal((await rawRequest(`${p.url}/instances`)).status, 401);
  let r = await admin('POST', { role: 'prefill_decode', url: d.url, ec_zmq_addrs: ['tcp://127.0.0.1:15040'] });
  assert.equal(r.status, 200);
  assert.deepEqual(r.json, { registered: d.url, role: 'decode' });
  assert.equal((await admin('POST', { role: 'encode', url: `${e.url}/` })).status, 200);
  assert.equal((await admin('POST', { role: 'encode', url: d.url })).status, 409);
  assert.equal((await admin('POST', { role: 'nobody', url: d.url })).status, 400);
  r = await admin('GET');
  assert.deepEqual(r.json.encode, { live: [e.url], evicted: [] });
  assert.deepEqual(r.json.decode, { live: [d.url], evicted: [] });

  const openai = client(p);
  await openai.chat.completions.create(chatWithImages());
  assert.equal(e.chats()[0].body.ec_transfer_params.consumer_zmq, 'tcp://127.0.0.1:15040');

  e.healthy = false;
  await eventually(async () => (await admin('GET')).json.encode.evicted.includes(e.url), 20000, 'eviction');
  const refused = await openai.chat.completions.create(chatWithImages()).catch((x) => x);
  assert.equal(refused.status, 503);
  assert.equal(refused.error.stage, 'encode');

  e.healthy = true;
  await eventually(async () => (await admin('GET')).json.encode.live.includes(e.url), 20000, 're-admission');
  await openai.chat.completions.create(chatWithImages());

  e.healthy = false;
  await eventually(async () => {
    const now = (await admin('GET')).json.encode;
    return now.live.length === 0 && now.evicted.length === 0;
  }, 20000, 'forgetting after the evicted TTL');

  r = await admin('DELETE', { url: d.url });
  assert.deepEqual(r.json, { unregistered: d.url, found: true });
  r = await rawRequest(`${p.url}/instances?url=${encodeURIComponent(d.url)}`, { method: 'DELETE', headers: { 'X-API-Key': key } });
  assert.equal(r.json.found, false);
  const none = await openai.chat.completions.create({ model: 'm', messages: [{ role: 'user', content: 'hi' }] }).catch((x) => x);
  assert.equal(none.status, 503);

  const noKey = await proxy(['--probe-interval', '0']);
  assert.equal((await rawRequest(`${noKey.url}/instances`, { headers: { 'X-API-Key': '' } })).status, 403);
});

test('SIGTERM: stops accepting, finishes the stream in flight, exits 0', async () => {
  const [d] = await engines('decode');
  const p = await proxy(['--decode', d.url, '--probe-interval', '0']);
  let release;
  d.streamGate = new Promise((r) => (release = r));
  const openai = client(p);
  const stream = await openai.chat.completions.create({ model: 'm', messages: [{ role: 'user', content: 'hi' }], stream: true });
  const iterator = stream[Symbol.asyncIterator]();
  const first = await iterator.next();
  assert.equal(first.value.choices[0].delta.content, 'Hello');

  p.child.kill('SIGTERM');
  // New connections are refused once the proxy stops accepting.
  await eventually(() => new Promise((resolve) => {
    const req = http.request({ host: '127.0.0.1', port: p.port, path: '/health', agent: false }, (res) => {
      res.resume();
      resolve(false);
    });
    req.on('error', (err) => resolve(err.code === 'ECONNREFUSED'));
    req.end();
  }), 20000, 'the listener to close');

  release();
  let text = first.value.choices[0].delta.content;
  for (let next = await iterator.next(); !next.done; next = await iterator.next()) text += next.value.choices[0].delta.content ?? '';
  assert.equal(text, 'Hello from the fake decode.');
  const { code } = await p.exited;
  assert.equal(code, 0);
});
