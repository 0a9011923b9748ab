// The wasm sandbox's worker: Pyodide, and the session's Python in it. It may read Pyodide's
// files and nothing else (no network, environment, processes, writes or system calls: Deno's
// permissions for this worker, set by host.mjs). It answers the main thread only.

let pyodide = null;
let driver = null;
let interrupt = null;
let streaming = null; // the id of the run whose output the interpreter's streams carry now
let tools = null; // the session's host tools ({manifest, module}) until the driver takes them

// Host tool calls (host_tools.py, in Pyodide): each frame goes to the service, which answers it
// by the frame's id; the promise given to Python settles with the answer frame's text. A call
// not answered in time, or cut off by an interrupt, rejects.
const MAX_TOOL_CALLS = 256;
const MAX_TIMER_MS = 2 ** 31 - 1; // setTimeout's longest
const INTERRUPTED = "the run was interrupted"; // host_tools.py raises KeyboardInterrupt on it
const toolCalls = new Map(); // call id -> { resolve, reject, timer }

let toolSeq = 0; // the calls' ids as the service sees them: this worker's own, never reused

globalThis.cirHostTool = (frame, timeoutMs) => new Promise((resolve, reject) => {
  let call = null;
  try {
    call = JSON.parse(frame);
  } catch {
    // left null: refused below
  }
  if (call === null || typeof call !== "object" || Array.isArray(call)) {
    reject(new Error("a host tool call that is not a JSON object"));
    return;
  }
  if (toolCalls.size >= MAX_TOOL_CALLS) {
    reject(new Error(`more than ${MAX_TOOL_CALLS} host tool calls at once`));
    return;
  }
  const id = ++toolSeq;
  const timer = setTimeout(() => {
    toolCalls.delete(id);
    reject(new Error("no answer from the host in time"));
  }, Math.min(MAX_TIMER_MS, Math.max(0, Number(timeoutMs) || 0)));
  toolCalls.set(id, { resolve, reject, timer });
  post("tool", null, JSON.stringify({ ...call, id }));
});

function endToolCalls(why) {
  for (const [id, call] of toolCalls) {
    clearTimeout(call.timer);
    toolCalls.delete(id);
    call.reject(new Error(why));
  }
}

// time.sleep in the session's Python (inside_pyodide.py): a wait an interrupt can end.
const sleeps = new Set();
globalThis.cirSleep = (ms) => new Promise((resolve, reject) => {
  const sleep = { reject, timer: null };
  sleep.timer = setTimeout(() => {
    sleeps.delete(sleep);
    resolve(null);
  }, Math.min(MAX_TIMER_MS, Math.max(0, Number(ms) || 0)));
  sleeps.add(sleep);
});

function endSleeps(why) {
  for (const sleep of sleeps) {
    clearTimeout(sleep.timer);
    sleeps.delete(sleep);
    sleep.reject(new Error(why));
  }
}

function setTools(given) {
  tools = given;
  if (driver !== null && tools !== null) {
    driver.set_tools(tools.manifest, tools.module);
    tools = null;
  }
}

function post(type, id, body) {
  self.postMessage({ type, id, body });
}

const STREAM_PIECE = 1024 * 1024; // one write's text goes in pieces of at most this

function writer(name) {
  const decoder = new TextDecoder();
  return {
    write(bytes) {
      const text = decoder.decode(bytes, { stream: true });
      if (streaming !== null) {
        for (let at = 0; at < text.length; at += STREAM_PIECE) {
          const piece = text.slice(at, at + STREAM_PIECE);
          post("stream", streaming, JSON.stringify({ name, text: piece }));
        }
      }
      return bytes.length;
    },
  };
}

// The session's memory limit, on the interpreter's Wasm memory: every growth past it fails
// (Emscripten's allocator then answers NULL, and Python raises MemoryError). The originals are
// kept in this module alone, out of the session's reach. The process's own limit (set by the
// service) is what holds whatever else the code allocates.
function capMemory(maxBytes) {
  const grow = WebAssembly.Memory.prototype.grow;
  const size = Object.getOwnPropertyDescriptor(WebAssembly.Memory.prototype, "buffer").get;
  const pages = Math.floor(maxBytes / 65536);
  WebAssembly.Memory.prototype.grow = function (delta) {
    if (size.call(this).byteLength / 65536 + Number(delta) > pages) {
      throw new RangeError("over the sandbox's memory limit");
    }
    return grow.call(this, delta);
  };
}

// Pyodide as the memory snapshot has it (taken once, before any session, by snapshot.mjs):
// a start in a fraction of a cold one's time; cold when there is none or it will not load.
async function load(message) {
  const { loadPyodide } = await import(new URL("pyodide.mjs", "file://" + message.indexURL + "/").href);
  // Packages come from the distribution's directory, never from Pyodide's CDN: where a file is
  // not there, Pyodide's fallback is this same directory.
  const local = message.indexURL + "/";
  const options = { indexURL: local, packageBaseUrl: local, env: { HOME: "/workspace" } };
  if (message.snapshot) {
    try {
      return await loadPyodide({ ...options, _loadSnapshot: Deno.readFileSync(message.snapshot) });
    } catch (error) {
      post("snapshot_failed", null, String(error?.message ?? error).slice(0, 2000));
    }
  }
  return await loadPyodide(options);
}

async function init(message) {
  if (message.tools && tools === null) tools = message.tools; // a later "tools" is newer
  capMemory(message.memoryBytes);
  // No threads of the session's own: a worker it started would run on past its executions.
  for (const name of ["Worker", "SharedWorker"]) delete globalThis[name];
  interrupt = message.interrupt;
  pyodide = await load(message);
  pyodide.setStdout(writer("stdout"));
  pyodide.setStderr(writer("stderr"));
  pyodide.setInterruptBuffer(interrupt);
  interrupt[0] = 0;
  pyodide.globals.set("_cir_wheels", message.wheelsDir ?? "");
  pyodide.globals.set("_cir_pyodide", message.indexURL);
  pyodide.runPython(message.driver);
  driver = pyodide.globals.get("_cir_driver");
  setTools(tools);
}

self.onmessage = async (event) => {
  const message = event.data;
  const id = typeof message.id === "number" ? message.id : null;
  try {
    if (message.op === "init") {
      try {
        await init(message);
      } catch (error) {
        post("init_failed", null, String(error?.message ?? error).slice(-2000));
        return;
      }
      post("ready", null, "{}");
    } else if (message.op === "run") {
      streaming = id;
      try {
        const outcome = await driver.run(message.code, JSON.stringify(message.env ?? {}),
          String(message.cwd ?? ""), (kind, content) => post(kind, id, content));
        post("done", id, outcome);
      } finally {
        if (streaming === id) streaming = null;
        interrupt[0] = 0;
      }
    } else if (message.op === "call") {
      post("reply", id, driver.call(message.fn, JSON.stringify(message.args ?? [])));
    } else if (message.op === "tools") {
      setTools({ manifest: String(message.manifest), module: String(message.module) });
    } else if (message.op === "tool_reply") {
      const call = toolCalls.get(message.call);
      if (call !== undefined) {
        clearTimeout(call.timer);
        toolCalls.delete(message.call);
        call.resolve(String(message.body));
      }
    } else if (message.op === "interrupt") {
      // Heard here, Python is not running: the run waits (on a host tool call, a sleep, a
      // promise). Its flag would be seen by whatever Python runs next, not by the run's
      // code: it is taken back, and the run is ended where it waits.
      interrupt[0] = 0;
      endToolCalls(INTERRUPTED); // the calls and sleeps it waits on raise KeyboardInterrupt,
      endSleeps(INTERRUPTED); // and its task is cancelled where it awaits
      if (driver !== null) driver.interrupt();
    }
  } catch (error) {
    post("failed", id, JSON.stringify({ message: String(error?.message ?? error).slice(-4000) }));
  }
};
