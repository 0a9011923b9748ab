"""The WebAssembly backend: Python as Pyodide under Deno, for code that must touch nothing
(docs/wasm.md)."""
