// The wasm sandbox's Deno process, main thread: the service's end of the sandbox. It connects
// to the session's Unix socket (the only path it may read and write besides Pyodide's files),
// runs Python in a worker that may read Pyodide's files (and the operator's wheels) and nothing
// else, and carries messages between the two. What the worker sends is untrusted: only the
// kinds a worker sends, for a run or call outstanding, and within size, are passed on; the
// service checks them again.
//
// Frames on the socket, both ways: a 4-byte big-endian length, then that many bytes of JSON.
// From the service: {op: "init", driver, memoryBytes, tools}, {op: "run", id, code, env, cwd},
// {op: "call", id, fn, args}, {op: "interrupt", id}, {op: "tools", manifest, module},
// {op: "tool_reply", call, body}. (An interrupt sets the worker's flag, which running code
// sees, and tells the worker, which ends a run that waits.) To the service: {type, id, body} (`body` a string: the
// worker's own JSON; a host tool call's frame is {type: "tool", id: null, body}),
// {type: "oversize", id, size}, {type: "worker_error", message}.

const [socketPath, indexURL, wheelsDir, snapshot] = Deno.args;
const MAX_FRAME = 64 * 1024 * 1024;
const MAX_OUTPUT = 8 * 1024 * 1024; // one output message (a stream's text, a rich result)
const OUTPUTS = new Set(["stream", "error", "execute_result", "display_data"]);
// How each kind of request ends: a run with its `done`, a call with its `reply` (either may
// fail instead).
const ENDS = { run: new Set(["done", "failed"]), call: new Set(["reply", "failed"]) };
const conn = await Deno.connect({ transport: "unix", path: socketPath });
const interrupt = new Uint8Array(new SharedArrayBuffer(1));
const encoder = new TextEncoder();
const decoder = new TextDecoder();
const outstanding = new Map(); // id -> "run" or "call": sent to the worker, not ended yet
let running = null; // the id of the run outstanding, if any: an interrupt is for it alone
let initializing = false;
let generation = 0; // of the worker, as the service numbers them: echoed on its start
let writing = Promise.resolve();

function send(message) {
  let bytes = encoder.encode(JSON.stringify(message));
  if (bytes.length > MAX_FRAME) {
    bytes = encoder.encode(JSON.stringify({ type: "oversize", id: message.id ?? null, size: bytes.length }));
  }
  const frame = new Uint8Array(4 + bytes.length);
  new DataView(frame.buffer).setUint32(0, bytes.length);
  frame.set(bytes, 4);
  writing = writing.then(async () => {
    let sent = 0;
    while (sent < frame.length) sent += await conn.write(frame.subarray(sent));
  });
  return writing;
}

function fromWorker(event) {
  const data = event.data;
  if (data === null || typeof data !== "object" || typeof data.type !== "string" ||
      typeof data.body !== "string") {
    return;
  }
  if (data.type === "ready" && initializing) {
    initializing = false;
    send({ type: "ready", id: null, body: "{}", generation });
    return;
  }
  if (data.type === "init_failed" && initializing) {
    initializing = false;
    send({ type: "worker_error", message: data.body.slice(0, 2000), generation });
    return;
  }
  if (data.type === "snapshot_failed" && initializing) { // it starts cold instead: told
    send({ type: "snapshot_failed", id: null, body: data.body.slice(0, 2000), generation });
    return;
  }
  if (data.type === "tool") { // a host tool call, whoever's: the service checks it
    if (data.body.length <= MAX_OUTPUT) send({ type: "tool", id: null, body: data.body, generation });
    return;
  }
  const id = data.id;
  const asked = outstanding.get(id);
  if (asked === undefined) return;
  const ends = ENDS[asked].has(data.type);
  if (!ends && !(asked === "run" && OUTPUTS.has(data.type))) return;
  if (ends) {
    outstanding.delete(id);
    if (id === running) {
      running = null;
      interrupt[0] = 0;
    }
  } else if (data.body.length > MAX_OUTPUT) {
    send({ type: "oversize", id, size: data.body.length, output: true });
    return;
  }
  send({ type: data.type, id, body: data.body });
}

let worker = null;
function startWorker(driver, memoryBytes, tools, number) {
  if (worker !== null) worker.terminate(); // a fresh interpreter: the old one's state goes
  outstanding.clear();
  running = null;
  initializing = true;
  generation = number ?? generation + 1;
  const started = new Worker(new URL("./worker.mjs", import.meta.url), {
    type: "module",
    deno: {
      permissions: {
        read: [indexURL, wheelsDir, snapshot].filter((path) => path),
        write: false, net: false, env: false, run: false, ffi: false, sys: false, import: false,
      },
    },
  });
  worker = started;
  // A worker replaced since is not heard: what it still sends is of no run or call now.
  started.onmessage = (event) => { if (started === worker) fromWorker(event); };
  started.onerror = (event) => {
    event.preventDefault();
    if (started !== worker) return;
    send({ type: "worker_error", message: String(event.message ?? "the worker failed").slice(0, 2000), generation });
  };
  interrupt[0] = 0;
  started.postMessage({
    op: "init", indexURL, wheelsDir, snapshot: snapshot || null, interrupt, driver, memoryBytes, tools,
  });
}

async function readExactly(n) {
  const out = new Uint8Array(n);
  let got = 0;
  while (got < n) {
    const read = await conn.read(out.subarray(got));
    if (read === null) return null;
    got += read;
  }
  return out;
}

while (true) {
  const head = await readExactly(4);
  if (head === null) break;
  const size = new DataView(head.buffer).getUint32(0);
  if (size > MAX_FRAME) break;
  const body = await readExactly(size);
  if (body === null) break;
  const message = JSON.parse(decoder.decode(body));
  if (message.op === "init") {
    startWorker(message.driver, message.memoryBytes, message.tools ?? null, message.generation);
  } else if (message.op === "interrupt") {
    if (running !== null && message.id === running) {
      interrupt[0] = 2; // KeyboardInterrupt next
      worker.postMessage({ op: "interrupt" }); // and, if it waits rather than runs, there
    }
  } else if (worker !== null && (message.op === "tools" || message.op === "tool_reply")) {
    worker.postMessage(message);
  } else if (worker !== null && (message.op === "run" || message.op === "call")) {
    outstanding.set(message.id, message.op);
    if (message.op === "run") {
      running = message.id;
      interrupt[0] = 0;
    }
    worker.postMessage(message);
  }
}
Deno.exit(0);
