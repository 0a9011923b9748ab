// Takes the memory snapshot wasm sandboxes start from (backend.py): Pyodide loaded as a
// sandbox's worker loads it, before anything of a session's runs, its memory written to the
// path given (the only one this process may write). No session's code is ever in it.

const [indexURL, outPath] = Deno.args;
const { loadPyodide } = await import(new URL("pyodide.mjs", "file://" + indexURL + "/").href);
const pyodide = await loadPyodide({
  indexURL: indexURL + "/",
  env: { HOME: "/workspace" },
  _makeSnapshot: true,
});
Deno.writeFileSync(outPath, pyodide.makeMemorySnapshot());
Deno.exit(0);
