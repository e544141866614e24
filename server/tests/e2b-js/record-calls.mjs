// Records which public calls of the E2B JS SDK each passing test makes, for the table in
// docs/e2b-compatibility.md (ops/e2b-compat.py). server/tests/e2b_js.rs preloads it
// (`node --import ./record-calls.mjs --test ...`) with OPENDSEC_E2B_CALLS naming the JSON
// file to write when the process ends; the test files do not know about it.
//
// Each method of the SDK's classes is replaced by a function that notes
// `Class.method` (the class it was called on: `Sandbox.kill` for `Sandbox.kill(id)` and
// `sbx.kill()` alike) and calls through, returning what the original returns: a promise
// stays a promise, a value a value. Calls the SDK makes to itself are not noted (an
// AsyncLocalStorage marks the time inside a noted call). Classes the packages do not
// export (Commands, Filesystem, CommandHandle, ...) are wrapped when an object of
// theirs first comes back from a noted call. Calls made in a test count once the test's
// function has resolved; calls made in file-level hooks (`before`, `after`) count under
// "hooks" when no test of the file failed.

import { AsyncLocalStorage } from 'node:async_hooks'
import { readFileSync, writeFileSync } from 'node:fs'
import { basename } from 'node:path'
import { createRequire, syncBuiltinESMExports } from 'node:module'
import * as e2b from 'e2b'
import * as codeInterpreter from '@e2b/code-interpreter'

const OUT = process.env.OPENDSEC_E2B_CALLS
// The SDK's classes, by their runtime names: objects of these are wrapped when met.
const SDK_CLASSES = new Set([
  'Sandbox', 'Commands', 'Filesystem', 'Pty', 'Git', 'CommandHandle', 'WatchHandle',
  'SandboxPaginator', 'SnapshotPaginator', 'SecretPaginator', 'TemplateBase', 'Volume', 'Secret',
])
const HOOKS = 'hooks'

const insideCall = new AsyncLocalStorage()
const currentTest = new AsyncLocalStorage()
const hookCalls = new Set()
const passed = {}
let anyFailed = false
const wrapped = new WeakSet()

function note(name) {
  ;(currentTest.getStore() ?? hookCalls).add(name)
}

function receiverName(self, owner) {
  if (typeof self === 'function' && self.name) return self.name
  if (self && typeof self === 'object' && self.constructor?.name) return self.constructor.name
  return owner
}

function adopt(value) {
  if (Array.isArray(value)) {
    value.forEach(adopt)
    return
  }
  if (!value || typeof value !== 'object') return
  const ctor = value.constructor
  if (typeof ctor !== 'function' || !SDK_CLASSES.has(ctor.name)) return
  wrapClass(ctor)
  for (const part of ['commands', 'files', 'pty', 'git']) adopt(value[part])
}

function wrapMethod(target, key, owner) {
  const d = Object.getOwnPropertyDescriptor(target, key)
  if (!d || typeof d.value !== 'function' || !d.writable || key.startsWith('_') || key === 'constructor') return
  const original = d.value
  const recorded = {
    [key](...args) {
      if (insideCall.getStore()) return original.apply(this, args)
      note(`${receiverName(this, owner)}.${key}`)
      const result = insideCall.run(true, () => original.apply(this, args))
      if (result && typeof result.then === 'function') {
        return result.then((v) => {
          adopt(v)
          return v
        })
      }
      adopt(result)
      return result
    },
  }[key]
  Object.defineProperty(target, key, { ...d, value: recorded })
}

// Wraps the methods of `cls`, its statics and those of the classes it extends.
function wrapClass(cls) {
  for (let c = cls; typeof c === 'function' && c !== Function.prototype; c = Object.getPrototypeOf(c)) {
    if (wrapped.has(c)) continue
    wrapped.add(c)
    for (const key of Object.getOwnPropertyNames(c)) {
      if (!['length', 'name', 'prototype'].includes(key)) wrapMethod(c, key, c.name)
    }
    for (const key of Object.getOwnPropertyNames(c.prototype ?? {})) wrapMethod(c.prototype, key, c.name)
  }
}

// `test(name, [options], fn)`: fn runs with its own set of calls, kept once it resolves.
function recordingTest(original) {
  const wrappedTest = function (...args) {
    const i = args.findLastIndex((a) => typeof a === 'function')
    if (i >= 0) {
      const fn = args[i]
      const name = typeof args[0] === 'string' ? args[0] : fn.name
      if (fn.length > 1) throw new Error(`record-calls.mjs: "${name}" takes a callback; write it as an async test`)
      args[i] = async function (t) {
        const calls = new Set()
        try {
          await currentTest.run(calls, () => fn.call(this, t))
        } catch (e) {
          anyFailed = true
          throw e
        }
        passed[name] = [...calls].sort()
      }
    }
    return original.apply(this, args)
  }
  return Object.assign(wrappedTest, original)
}

if (OUT) {
  for (const m of [e2b, codeInterpreter]) {
    for (const v of Object.values(m)) {
      if (typeof v === 'function' && SDK_CLASSES.has(v.name)) wrapClass(v)
    }
  }
  // `Template` is a function that makes a TemplateBase; its statics are its own.
  for (const key of Object.getOwnPropertyNames(e2b.Template)) wrapMethod(e2b.Template, key, 'TemplateBase')

  const nodeTest = createRequire(import.meta.url)('node:test')
  nodeTest.test = recordingTest(nodeTest.test)
  nodeTest.it = recordingTest(nodeTest.it)
  syncBuiltinESMExports()

  process.on('exit', () => {
    const tests = { ...passed }
    if (!anyFailed && hookCalls.size) tests[HOOKS] = [...hookCalls].sort()
    const sdk = JSON.parse(readFileSync(new URL('./node_modules/e2b/package.json', import.meta.url), 'utf8')).version
    const module = basename(process.argv[1] ?? '')
    writeFileSync(OUT, JSON.stringify({ sdk: `e2b ${sdk}`, language: 'js', module, tests }, null, 1))
  })
}
