// SPDX-License-Identifier: AGPL-3.0-only
// The JavaScript side of OpenDsec's JavaScript and TypeScript kernels
// (node_kernel.py): one persistent node process per kernel. Cells arrive as JSON lines
// on one pipe, replies (results, errors, the end of a cell) leave as JSON lines on
// another (`--fds=<requests>,<replies>`);
// the cell's own output goes to this process's stdout and stderr, which the kernel
// streams. Every reply is written synchronously after the output it follows, so the
// kernel sees a cell's output before its end.
'use strict';

const fs = require('fs');
const path = require('path');
const util = require('util');
const vm = require('vm');
const readline = require('readline');
const { createRequire } = require('module');

function option(name) {
  const arg = process.argv.find((a) => a.startsWith(`--${name}=`));
  return arg === undefined ? undefined : arg.slice(name.length + 3);
}
const [requestFd, replyFd] = option('fds').split(',').map(Number);
// The typescript package's directory, as the server found it.
const typescriptDir = option('typescript');
const typescript = typescriptDir !== undefined;
const ts = typescript ? require(typescriptDir) : null;

function reply(message) {
  fs.writeSync(replyFd, JSON.stringify(message) + '\n');
}

// Cells see `require` resolving from the working directory (then node's global paths),
// as a script in that directory would, plus `module` and `exports` for transpiled code.
const cellModule = { exports: {} };
globalThis.require = createRequire(path.join(process.cwd(), '[cell]'));
globalThis.module = cellModule;
globalThis.exports = cellModule.exports;

function bundle(value) {
  const data = { 'text/plain': util.inspect(value, { depth: 4, colors: false }) };
  if (value !== null && typeof value === 'object') {
    for (const [method, mime] of [['_toHtml', 'text/html'], ['_toMarkdown', 'text/markdown'], ['_toSvg', 'image/svg+xml'], ['_toPng', 'image/png']]) {
      if (typeof value[method] === 'function') data[mime] = String(value[method]());
    }
  }
  return data;
}

// display(value) shows a value as a result that is not the cell's main one.
globalThis.display = (value) => {
  reply({ type: 'display', data: bundle(value) });
};

function transpile(code) {
  const out = ts.transpileModule(code, {
    compilerOptions: { target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.CommonJS, alwaysStrict: false, esModuleInterop: true },
    reportDiagnostics: false,
  }).outputText;
  // A strict cell could not assign an undeclared global, which a script may.
  return out.replace(/^"use strict";\r?\n/, '').replace(/^Object\.defineProperty\(exports, "__esModule", \{ value: true \}\);\r?\n/m, '');
}

let running = null;

async function run(code) {
  const source = typescript ? transpile(code) : code;
  let value;
  let script = null;
  try {
    script = new vm.Script(source, { filename: 'cell' });
  } catch (e) {
    if (!(e instanceof SyntaxError) || !/\bawait\b/.test(source)) throw e;
  }
  if (script !== null) {
    value = script.runInThisContext({ breakOnSigint: true, displayErrors: false });
  } else {
    // Top-level await: the cell runs as an async function (its declarations stay in it).
    value = new vm.Script(`(async () => {\n${source}\n})()`, { filename: 'cell' }).runInThisContext({ breakOnSigint: true });
  }
  if (value !== null && typeof value === 'object' && typeof value.then === 'function') {
    value = await new Promise((resolve, reject) => {
      running = reject;
      value.then(resolve, reject);
    });
  }
  return value;
}

// An interrupt (SIGINT to the kernel's process group) stops a synchronous cell through
// breakOnSigint and rejects the promise an asynchronous one waits on.
process.on('SIGINT', () => {
  if (running) running(Object.assign(new Error('Script execution was interrupted'), { name: 'KeyboardInterrupt' }));
});

async function serve() {
  const lines = readline.createInterface({ input: fs.createReadStream(null, { fd: requestFd }) });
  for await (const line of lines) {
    const request = JSON.parse(line);
    try {
      const value = await run(request.code);
      running = null;
      if (value !== undefined) reply({ type: 'result', data: bundle(value) });
    } catch (e) {
      running = null;
      const error = e instanceof Error ? e : new Error(util.inspect(e));
      const interrupted = /execution (was )?interrupted/i.test(error.message);
      reply({
        type: 'error',
        ename: interrupted ? 'KeyboardInterrupt' : error.name || 'Error',
        evalue: error.message,
        // The cell's own frames: those of this driver and of vm say nothing to the user.
        traceback: [(error.stack || `${error.name}: ${error.message}`).split('\n').filter((l) => !/node_kernel\.js|\(node:vm:|at node:vm/.test(l)).join('\n')],
      });
    }
    reply({ type: 'done' });
  }
  process.exit(0);
}

// An error no cell is waiting for (a timer's, an unhandled rejection) is reported on
// stderr, as node would, without ending the kernel.
process.on('uncaughtException', (e) => process.stderr.write(`Uncaught ${e && e.stack ? e.stack : e}\n`));
process.on('unhandledRejection', (e) => process.stderr.write(`Unhandled rejection ${e && e.stack ? e.stack : e}\n`));

serve();
