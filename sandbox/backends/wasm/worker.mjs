// The wasm sandbox's worker: Pyodide, and the session's Python in it. It may read Pyodide's
// files and nothing else (no network, environment, processes, writes or system calls: Deno's
// permissions for this worker, set by host.mjs). It answers the main thread only.

let pyodide = null;
let driver = null;
let current = null; // the id of the message being handled: outputs are tagged with it

function post(type, body) {
  self.postMessage({ type, id: current, body });
}

function writer(name) {
  const decoder = new TextDecoder();
  return {
    write(bytes) {
      const text = decoder.decode(bytes, { stream: true });
      if (text) post("stream", JSON.stringify({ name, text }));
      return bytes.length;
    },
  };
}

// The session's memory limit, on the interpreter's Wasm memory: every growth past it fails
// (Emscripten's allocator then answers NULL, and Python raises MemoryError). The original
// `grow` is kept in this module alone, out of the session's reach.
function capMemory(maxBytes) {
  const grow = WebAssembly.Memory.prototype.grow;
  const pages = Math.floor(maxBytes / 65536);
  WebAssembly.Memory.prototype.grow = function (delta) {
    if (this.buffer.byteLength / 65536 + Number(delta) > pages) {
      throw new RangeError("over the sandbox's memory limit");
    }
    return grow.call(this, delta);
  };
}

async function init(message) {
  capMemory(message.memoryBytes);
  const { loadPyodide } = await import(new URL("pyodide.mjs", "file://" + message.indexURL + "/").href);
  pyodide = await loadPyodide({
    indexURL: message.indexURL + "/",
    env: { HOME: "/workspace", CIR_WHEELS: message.wheelsDir ?? "" },
  });
  pyodide.setStdout(writer("stdout"));
  pyodide.setStderr(writer("stderr"));
  pyodide.setInterruptBuffer(message.interrupt);
  pyodide.runPython(message.driver);
  driver = pyodide.globals.get("_cir_driver");
  post("ready", "{}");
}

self.onmessage = async (event) => {
  const message = event.data;
  try {
    if (message.op === "init") {
      await init(message);
    } else if (message.op === "run") {
      current = message.id;
      const outcome = await driver.run(message.code, JSON.stringify(message.env ?? {}),
        String(message.cwd ?? ""), (kind, content) => post(kind, content));
      post("done", outcome);
    } else if (message.op === "call") {
      current = message.id;
      post("reply", driver.call(message.fn, JSON.stringify(message.args ?? [])));
    }
  } catch (error) {
    post("failed", JSON.stringify({ message: String(error?.message ?? error).slice(-4000) }));
  } finally {
    current = null;
  }
};
