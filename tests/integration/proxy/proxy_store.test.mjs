// `ecx proxy --store-url`: images already in the encoders' shared store skip the
// encoder hop. The real binary, a real redis-server, fake engines and the official
// openai client, all on 127.0.0.1. The test writes and deletes the store's keys itself
// (what an encoder with cross_encoder_cache would publish) and waits for the proxy's
// presence index through its own metrics, each wait bounded.
import { test, before } from 'node:test';
import assert from 'node:assert/strict';
import { closedPort, eventually, sha256, engineHash } from './fake_engines.mjs';
import { useFixtures, client, image, rawRequest, sample } from './harness.mjs';
import { startRedis } from './redis.mjs';

const HEX32 = /^[0-9a-f]{32}$/;
const PREFIX = 'ecxtest';
const MODEL = 'Org/vl-model@rev1';
const IMG_A = 'https://example.invalid/store-a.png';
const IMG_B = 'https://example.invalid/store-b.png';
const IMG_C = 'https://example.invalid/store-c.png';
// What the fake encoder reports for an image sent without kwargs (its uuid is the proxy's content id).
const hashOf = (url) => engineHash(sha256(url), {});
const keyOf = (url) => `${PREFIX}:${MODEL}:${hashOf(url)}`;

const { engines, proxy, cleanups } = useFixtures();
let redis;
before(async () => {
  redis = await startRedis();
  cleanups.push(() => redis.kill());
});

const chat = (...urls) => ({
  model: 'fake-model',
  messages: [{ role: 'user', content: [{ type: 'text', text: 'What is this?' }, ...urls.map(image)] }],
});

async function metrics(p) {
  return (await rawRequest(`${p.url}/metrics`)).text;
}

// Waits (bounded) until the proxy's presence index knows `entries` store entries.
async function indexHolds(p, entries) {
  await eventually(async () => sample(await metrics(p), 'ecx_store_presence_entries') === entries, 20000,
                   `the presence index to hold ${entries} entries`);
}

function storeArgs(url = redis.url) {
  return ['--store-url', url, '--store-prefix', PREFIX, '--store-model', MODEL];
}

test('start-up: a bad --store-url or a missing --store-model stops the proxy with an error naming the flag', async () => {
  const [e, d] = await engines('encode', 'decode');
  const base = ['--encode', e.url, '--decode', d.url, '--probe-interval', '0'];
  let err = await proxy([...base, '--store-url', 'http://127.0.0.1:1', '--store-model', MODEL]).catch((x) => x);
  assert.match(err.message, /exited with 2: .*--store-url: 'http:\/\/127\.0\.0\.1:1' has scheme 'http'.*expected redis:\/\//s);
  err = await proxy([...base, '--store-url', redis.url]).catch((x) => x);
  assert.match(err.message, /exited with 2: .*--store-model is required with --store-url/s);
});

test('a store that is down at start does not stop the proxy: requests go through the encoders', async () => {
  const [e, d] = await engines('encode', 'decode');
  const p = await proxy(['--encode', e.url, '--decode', d.url, '--probe-interval', '0',
                         ...storeArgs(`redis://127.0.0.1:${await closedPort()}/0`)]);
  const openai = client(p);
  for (let i = 0; i < 2; ++i) {
    const answer = await openai.chat.completions.create(chat(IMG_A));
    assert.equal(answer.choices[0].message.content, 'Hello from the fake decode.');
  }
  assert.equal(e.chats().length, 2);
  const text = await metrics(p);
  assert.equal(sample(text, 'ecx_proxy_encode_skipped_total'), 0);
  assert.equal(sample(text, 'ecx_proxy_store_checks_total{result="unknown"}'), 1);
  assert.equal(sample(text, 'ecx_proxy_store_checks_total{result="miss"}'), 1, 'learned, the store cannot confirm it');
});

test('E+PD: stored images skip the encoder, partly stored requests encode only the rest, deleted entries are encoded again', async () => {
  const [e, d] = await engines('encode', 'decode');
  const p = await proxy(['--encode', e.url, '--decode', d.url, '--ec-consumer-zmq-addrs', 'tcp://127.0.0.1:15100',
                         '--probe-interval', '0', '--log-level', 'debug', ...storeArgs()]);
  const openai = client(p);

  // (a) First meeting: encoded; the proxy learns the engine hash from the answer.
  await openai.chat.completions.create(chat(IMG_A));
  assert.equal(e.chats().length, 1);
  assert.deepEqual(d.chats()[0].body.ec_transfer_params.ec_items.map((i) => i.mm_hash), [hashOf(IMG_A)]);
  let text = await metrics(p);
  assert.equal(sample(text, 'ecx_proxy_store_checks_total{result="unknown"}'), 1);
  assert.equal(sample(text, 'ecx_proxy_store_learned_hashes'), 1);

  // An encoder publishes it to the store.
  assert.equal(await redis.command(['SET', keyOf(IMG_A), 'entry']), 'OK');
  await indexHolds(p, 1);

  // (b) The same image again: no encoder, the consumer gets it raw with its uuid and a store item.
  const answer = await openai.chat.completions.create({ ...chat(IMG_A), ec_transfer_params: { client_field: 7 } },
                                                      { headers: { 'x-request-id': 'stored-1' } });
  assert.equal(answer.choices[0].message.content, 'Hello from the fake decode.');
  assert.equal(e.chats().length, 1, 'the encoder received nothing');
  const skipped = d.chats().at(-1);
  assert.equal(skipped.headers['x-request-id'], 'stored-1');
  assert.equal(skipped.headers.authorization, 'Bearer test-key');
  assert.deepEqual(skipped.body.messages[0].content[1], { ...image(IMG_A), uuid: sha256(IMG_A) });
  assert.deepEqual(skipped.body.ec_transfer_params, {
    client_field: 7,
    ec_items: [{ mm_hash: hashOf(IMG_A), store: true }],
  });
  await eventually(() => /request stored-1: all 1 image\(s\) are in the store; no encoder called/.test(p.stderr()),
                   20000, 'the debug line of the skipped request');

  // (c) One image stored, one not: only the other is encoded; each keeps its position.
  await openai.chat.completions.create(chat(IMG_A, IMG_B), { headers: { 'x-request-id': 'partly-1' } });
  assert.equal(e.chats().length, 2);
  const encoded = e.chats().at(-1);
  assert.match(encoded.headers['x-request-id'], /^partly-1:1:[0-9a-f]{6}$/, 'item 1 only');
  assert.deepEqual(encoded.body.messages[0].content.map((part) => part.image_url.url), [IMG_B]);
  const transferB = encoded.body.ec_transfer_params.ec_items[0].transfer_id;
  assert.match(transferB, HEX32);
  const partly = d.chats().at(-1).body;
  assert.deepEqual(partly.ec_transfer_params.ec_items, [
    { mm_hash: hashOf(IMG_A), store: true },
    { mm_hash: hashOf(IMG_B), transfer_id: transferB },
  ]);
  assert.deepEqual(partly.messages[0].content[1], { ...image(IMG_A), uuid: sha256(IMG_A) });
  assert.equal(partly.messages[0].content[2].type, 'image_embeds');

  // Both stored: one request, no encoder, both store items in order.
  await redis.command(['SET', keyOf(IMG_B), 'entry']);
  await indexHolds(p, 2);
  await openai.chat.completions.create(chat(IMG_B, IMG_A));
  assert.equal(e.chats().length, 2);
  assert.deepEqual(d.chats().at(-1).body.ec_transfer_params.ec_items,
                   [{ mm_hash: hashOf(IMG_B), store: true }, { mm_hash: hashOf(IMG_A), store: true }]);

  // (d) The entry is deleted (or expired, or evicted): encoded again.
  assert.equal(await redis.command(['DEL', keyOf(IMG_A)]), 1);
  await indexHolds(p, 1);
  await openai.chat.completions.create(chat(IMG_A));
  assert.equal(e.chats().length, 3);
  const again = d.chats().at(-1).body.ec_transfer_params.ec_items;
  assert.equal(again.length, 1);
  assert.equal(again[0].mm_hash, hashOf(IMG_A));
  assert.match(again[0].transfer_id, HEX32);
  assert.equal(again[0].store, undefined);

  // (f) The counts, and no encode stage for the requests that skipped it.
  text = await metrics(p);
  assert.equal(sample(text, 'ecx_proxy_encode_skipped_total'), 2);
  assert.equal(sample(text, 'ecx_proxy_items_forwarded_total{form="store"}'), 4);
  assert.equal(sample(text, 'ecx_proxy_store_checks_total{result="hit"}'), 4);
  assert.equal(sample(text, 'ecx_proxy_store_checks_total{result="unknown"}'), 2);
  assert.equal(sample(text, 'ecx_proxy_store_checks_total{result="miss"}'), 1);
  assert.equal(sample(text, 'ecx_proxy_store_learned_hashes'), 2);
  assert.equal(sample(text, 'ecx_proxy_stage_seconds_count{stage="encode"}'), 3);
  assert.equal(sample(text, 'ecx_proxy_stage_seconds_count{stage="total"}'), 5);
  assert.equal(sample(text, 'ecx_proxy_upstream_requests_total{stage="encode",outcome="ok"}'), 3);
  assert.equal(sample(text, 'ecx_proxy_media_items_total{modality="image"}'), 7);
  assert.ok(sample(text, 'ecx_store_presence_hits_total') >= 4, 'the presence index exports its own series');
});

test('E+P+D: a stored image goes straight to the prefill as a store item, the decode gets what the prefill returned', async () => {
  const [e, pf, d] = await engines('encode', 'prefill', 'decode');
  const p = await proxy(['--encode', e.url, '--prefill', pf.url, '--decode', d.url, '--probe-interval', '0',
                         ...storeArgs()]);
  const openai = client(p);
  await openai.chat.completions.create(chat(IMG_C));  // learns the engine hash
  assert.equal(e.chats().length, 1);
  await redis.command(['SET', keyOf(IMG_C), 'entry']);
  await indexHolds(p, 1);  // the feed tells of changes since the proxy started (IMG_B is not asked about)

  let text = '';
  const stream = await openai.chat.completions.create({ ...chat(IMG_C), stream: true });
  for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? '';
  assert.equal(text, 'Hello from the fake decode.');
  assert.equal(e.chats().length, 1, 'the encoder received nothing');
  const prefill = pf.chats().at(-1).body;
  assert.deepEqual(prefill.ec_transfer_params, { ec_items: [{ mm_hash: hashOf(IMG_C), store: true }] });
  assert.deepEqual(prefill.messages[0].content[1], { ...image(IMG_C), uuid: sha256(IMG_C) });
  assert.equal(prefill.kv_transfer_params.do_remote_decode, true);
  const decode = d.chats().at(-1).body;
  assert.equal(decode.kv_transfer_params.remote_engine_id, 'prefill0-engine');
  assert.deepEqual(decode.ec_transfer_params.ec_items, [{ mm_hash: hashOf(IMG_C), store: true }]);
});

test('the store killed mid-run: the index forgets everything and requests go through the encoders', async () => {
  const [e, d] = await engines('encode', 'decode');
  const p = await proxy(['--encode', e.url, '--decode', d.url, '--probe-interval', '0', ...storeArgs()]);
  const openai = client(p);
  // Stored before this proxy started: the feed never told of it, a lookup confirms it.
  await openai.chat.completions.create(chat(IMG_B));  // learns the engine hash
  await openai.chat.completions.create(chat(IMG_B));  // a miss; the index looks it up off the request path
  await indexHolds(p, 1);
  await openai.chat.completions.create(chat(IMG_B));
  assert.equal(e.chats().length, 2, 'skipped once the lookup confirmed it');

  await redis.kill();
  await indexHolds(p, 0);
  for (let i = 0; i < 3; ++i) {
    const answer = await openai.chat.completions.create(chat(IMG_B));
    assert.equal(answer.choices[0].message.content, 'Hello from the fake decode.');
  }
  assert.equal(e.chats().length, 5, 'every request after the kill was encoded');
  const last = d.chats().at(-1).body.ec_transfer_params.ec_items;
  assert.deepEqual(last.map((i) => [i.mm_hash, i.store]), [[hashOf(IMG_B), undefined]]);
  const text = await metrics(p);
  assert.equal(sample(text, 'ecx_proxy_encode_skipped_total'), 1);
  assert.ok(sample(text, 'ecx_store_presence_feed_errors_total') >= 1);
});
