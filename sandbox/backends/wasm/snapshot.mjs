// Takes the memory snapshot wasm sandboxes start from (backend.py): Pyodide loaded as a
// sandbox's worker loads it, with the standard modules its driver (inside_pyodide.py) imports,
// before anything of a session's runs; its memory written to the path given (the only one this
// process may write). No session's code is ever in it. (`random` is among them: each session
// seeds it afresh as it starts.)

const [indexURL, outPath] = Deno.args;
const { loadPyodide } = await import(new URL("pyodide.mjs", "file://" + indexURL + "/").href);
const pyodide = await loadPyodide({
  indexURL: indexURL + "/",
  packageBaseUrl: indexURL + "/", // as worker.mjs loads it: nothing from Pyodide's CDN
  env: { HOME: "/workspace" },
  _makeSnapshot: true,
});
pyodide.runPython(
  "import asyncio, base64, concurrent.futures, contextvars, importlib, importlib.metadata, " +
    "inspect, io, itertools, json, keyword, random, re, shutil, stat, sysconfig, traceback, " +
    "types, typing, zipfile, pyodide.code, pyodide.ffi",
);
Deno.writeFileSync(outPath, pyodide.makeMemorySnapshot());
Deno.exit(0);
