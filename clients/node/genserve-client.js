#!/usr/bin/env node
// Calls a genserve server: the gRPC health check, Generate, GenerateBatch and
// GenerateStream, each under its own deadline.
//
// The channel uses the round_robin load-balancing policy, so a dns:/// target that
// resolves to several addresses (a headless Kubernetes Service), or an
// ipv4:ADDR:PORT,ADDR:PORT list, spreads calls per request across every replica.
//
//   node genserve-client.js --target dns:///genserve.default.svc.cluster.local:50051 health
//   node genserve-client.js --max-new-tokens 16 generate "The capital of France is"
//   node genserve-client.js batch "1, 2, 3," "a, b, c,"
//   node genserve-client.js stream "Once upon a time"
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const REPO = path.resolve(__dirname, '..', '..');
const PROTO_DIRS = [path.join(REPO, 'protos'), path.join(REPO, 'clients', 'proto')];

const USAGE = `usage: genserve-client [flags] COMMAND [ARGS]

commands:
  health              grpc.health.v1 Check; exits 0 only when SERVING
  generate PROMPT...  one Generate call per prompt
  batch PROMPT...     one GenerateBatch call, one item per prompt (errors per item)
  stream PROMPT       GenerateStream, printing every chunk as it arrives

flags:
  --target T          server target: host:port, dns:///name:port or ipv4:A:P,B:P (all
                      addresses, round_robin) (default dns:///localhost:50051)
  --timeout D         deadline of each call: 30s, 500ms, 2m or seconds (default 60s)
  --max-new-tokens N  stopping.max_new_tokens (default 32)
  --temperature F     sampling.temperature (0 = greedy, the default)
  --top-p F           sampling.top_p (0 = leave unset)
  --max-attempts N    attempts per call answered UNAVAILABLE (1 = no retries, at most
                      5; default 5)`;

// The channel's service config: round_robin (one subchannel per resolved address, calls
// spread over the READY ones in turn) and, when maxAttempts > 1, a retry policy for
// GenerationService calls answered UNAVAILABLE (nothing ran: a replica draining or not
// ready), on the next replica first. A call that got a response header is never retried:
// a stream is not repeated once it has started.
function serviceConfig(maxAttempts) {
  const config = {loadBalancingConfig: [{round_robin: {}}]};
  if (maxAttempts > 1) {
    config.methodConfig = [{
      name: [{service: 'genserve.v1.GenerationService'}],
      retryPolicy: {maxAttempts, initialBackoff: '0.1s', maxBackoff: '2s',
        backoffMultiplier: 2, retryableStatusCodes: ['UNAVAILABLE']},
    }];
  }
  return JSON.stringify(config);
}

class UsageError extends Error {}

function parseDurationMs(text) {
  const m = /^([0-9]*\.?[0-9]+)(ms|s|m)?$/.exec(text);
  if (!m) throw new UsageError(`not a duration: ${text}`);
  return Math.round(Number(m[1]) * {ms: 1, s: 1000, m: 60000}[m[2] || 's']);
}

function parseArgs(argv) {
  const opts = {target: 'dns:///localhost:50051', timeoutMs: 60000, maxNewTokens: 32,
    temperature: 0, topP: 0, maxAttempts: 5};
  const setters = {
    '-target': (v) => { opts.target = v; },
    '-timeout': (v) => { opts.timeoutMs = parseDurationMs(v); },
    '-max-new-tokens': (v) => { opts.maxNewTokens = Number.parseInt(v, 10); },
    '-temperature': (v) => { opts.temperature = Number(v); },
    '-top-p': (v) => { opts.topP = Number(v); },
    '-max-attempts': (v) => { opts.maxAttempts = Number.parseInt(v, 10); },
  };
  // Flags first, as with Go's flag package; the first non-flag argument, or "--", ends them.
  let i = 0;
  for (; i < argv.length && argv[i].startsWith('-') && argv[i] !== '-'; i++) {
    if (argv[i] === '--') { i++; break; }
    const flag = argv[i].startsWith('--') ? argv[i].slice(1) : argv[i];
    if (flag === '-h' || flag === '-help') { console.log(USAGE); process.exit(0); }
    if (!(flag in setters)) throw new UsageError(`unknown flag: ${argv[i]}`);
    if (i + 1 >= argv.length) throw new UsageError(`flag needs a value: ${argv[i]}`);
    setters[flag](argv[++i]);
  }
  for (const [name, v] of Object.entries(opts)) {
    if (typeof v === 'number' && !Number.isFinite(v)) throw new UsageError(`bad --${name}`);
  }
  const [command = '', ...rest] = argv.slice(i);
  const ok = (command === 'health' && rest.length === 0) ||
    ((command === 'generate' || command === 'batch') && rest.length > 0) ||
    (command === 'stream' && rest.length === 1);
  if (!ok) throw new UsageError('');
  if (!(opts.maxAttempts >= 1 && opts.maxAttempts <= 5)) throw new UsageError('bad --max-attempts');
  return {opts, command, rest};
}

function loadPackage(file) {
  return grpc.loadPackageDefinition(protoLoader.loadSync(file, {
    includeDirs: PROTO_DIRS, keepCase: true, enums: String, longs: Number, defaults: true,
    oneofs: true,
  }));
}

// A gRPC status turned into a message that says what to do about it.
function describe(code, details, timeoutMs) {
  const d = details || '';
  switch (code) {
    case grpc.status.INVALID_ARGUMENT: return `invalid request: ${d}`;
    case grpc.status.UNAVAILABLE:
      return `server unavailable (not running, still loading the model, or draining): ${d}`;
    case grpc.status.DEADLINE_EXCEEDED: return `deadline exceeded (${timeoutMs}ms): ${d}`;
    case grpc.status.RESOURCE_EXHAUSTED:
      return `server overloaded (waiting queue full), retry later: ${d}`;
    case grpc.status.CANCELLED: return `call cancelled: ${d}`;
    case grpc.status.INTERNAL: return `server error: ${d}`;
    case grpc.status.UNIMPLEMENTED: return `not supported by this server: ${d}`;
    default: return `${grpc.status[code] || code}: ${d}`;
  }
}

const quote = (s) => JSON.stringify(s);
const finishName = (reason) => String(reason).replace(/^FINISH_REASON_/, '');

function completion(resp) {
  if (!resp.completions.length) return 'no completions';
  const first = resp.completions[0];
  const tokens = resp.usage ? resp.usage.completion_tokens : 0;
  return `finish=${finishName(first.finish_reason)} completion_tokens=${tokens} ` +
    `text=${quote(first.text)}`;
}

// Promise wrapper for a unary call with its own deadline.
function unary(client, method, request, timeoutMs) {
  return new Promise((resolve, reject) => {
    client[method](request, {deadline: Date.now() + timeoutMs},
      (err, resp) => (err ? reject(err) : resolve(resp)));
  });
}

async function main() {
  let parsed;
  try {
    parsed = parseArgs(process.argv.slice(2));
  } catch (e) {
    if (!(e instanceof UsageError)) throw e;
    console.error(e.message ? `error: ${e.message}\n${USAGE}` : USAGE);
    return 2;
  }
  const {opts, command, rest} = parsed;
  const genserve = loadPackage('genserve/v1/generation.proto').genserve.v1;
  const health = loadPackage('grpc/health/v1/health.proto').grpc.health.v1;
  const channelOptions = {'grpc.service_config': serviceConfig(opts.maxAttempts)};
  const creds = grpc.credentials.createInsecure();
  const gen = new genserve.GenerationService(opts.target, creds, channelOptions);
  const healthClient = new health.Health(opts.target, creds, channelOptions);

  const request = (prompt) => {
    const sampling = {};
    if (opts.temperature !== 0) sampling.temperature = opts.temperature;
    if (opts.topP !== 0) sampling.top_p = opts.topP;
    return {prompt, sampling, stopping: {max_new_tokens: opts.maxNewTokens}};
  };

  try {
    if (command === 'health') {
      const resp = await unary(healthClient, 'Check', {service: ''}, opts.timeoutMs);
      console.log(`health: ${resp.status}`);
      if (resp.status !== 'SERVING') {
        console.error('error: server is not SERVING');
        return 1;
      }
    } else if (command === 'generate') {
      for (const [i, prompt] of rest.entries()) {
        const resp = await unary(gen, 'Generate', request(prompt), opts.timeoutMs);
        console.log(`generate[${i}] ${completion(resp)}`);
      }
    } else if (command === 'batch') {
      const resp = await unary(gen, 'GenerateBatch', {requests: rest.map(request)},
        opts.timeoutMs);
      for (const result of resp.results) {
        if (result.outcome === 'response') {
          console.log(`batch[${result.index}] ok ${completion(result.response)}`);
        } else {
          console.log(`batch[${result.index}] error: ` +
            describe(result.error.code, result.error.message, opts.timeoutMs));
        }
      }
    } else {
      // The deadline covers the whole stream.
      const call = gen.GenerateStream({request: request(rest[0])},
        {deadline: Date.now() + opts.timeoutMs});
      let text = '';
      let finish = 'FINISH_REASON_UNSPECIFIED';
      let tokens = 0;
      let chunk = 0;
      for await (const msg of call) {
        console.log(`chunk[${chunk++}] ${quote(msg.text)}`);
        text += msg.text;
        if (msg.finish_reason !== 'FINISH_REASON_UNSPECIFIED') finish = msg.finish_reason;
        if (msg.usage) tokens = msg.usage.completion_tokens;
      }
      console.log(`stream finish=${finishName(finish)} completion_tokens=${tokens} ` +
        `text=${quote(text)}`);
    }
  } catch (err) {
    if (err.code === undefined) throw err;
    console.error(`error: ${describe(err.code, err.details, opts.timeoutMs)}`);
    return 1;
  } finally {
    gen.close();
    healthClient.close();
  }
  return 0;
}

main().then((code) => { process.exitCode = code; });
