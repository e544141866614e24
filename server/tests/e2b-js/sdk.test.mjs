// Specification: the unmodified E2B JS SDK (`e2b` with `@e2b/code-interpreter`, the
// versions locked in current/ and previous/) works against OpenDsec with only its own
// variables set: E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL. server/tests/e2b_js.rs
// starts a real `opendsec up`, installs this file beside the SDK (ops/e2b-js.sh) and
// runs it with `node --test`. Uses only the SDK's public API.

import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { Sandbox, CommandExitError, NotFoundError, FileType } from 'e2b'
import { Sandbox as CodeInterpreter } from '@e2b/code-interpreter'

for (const v of ['E2B_API_KEY', 'E2B_API_URL', 'E2B_SANDBOX_URL']) {
  if (!process.env[v]) {
    throw new Error(`${v} is not set: run this suite through cargo test -p opendsec --test e2b_js`)
  }
}

const TEMPLATE = 'base'
const run = randomUUID().slice(0, 12)
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

async function waitUntil(probe, what, withinMs = 15000) {
  const deadline = Date.now() + withinMs
  let last
  for (;;) {
    last = await probe()
    if (last) return last
    if (Date.now() > deadline) assert.fail(`${what}: not within ${withinMs} ms (last: ${JSON.stringify(last)})`)
    await sleep(200)
  }
}

let sbx
before(async () => {
  sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 300_000, metadata: { suite: run, group: 'main' }, envs: { WHO: 'js' } })
})
after(async () => {
  await sbx?.kill()
})

test('create returns a running sandbox with its metadata', async () => {
  assert.match(sbx.sandboxId, /\S/)
  assert.equal(await sbx.isRunning(), true)
  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.equal(info.metadata.suite, run)
  assert.equal(info.state, 'running')
})

test('commands: stdout, stderr, env and exit codes', async () => {
  const r = await sbx.commands.run('echo hello $WHO; echo oops >&2')
  assert.equal(r.stdout, 'hello js\n')
  assert.equal(r.stderr, 'oops\n')
  assert.equal(r.exitCode, 0)
  await assert.rejects(sbx.commands.run('exit 3'), (e) => e instanceof CommandExitError && e.exitCode === 3)
  const seen = []
  await sbx.commands.run('for i in 1 2 3; do echo $i; done', { onStdout: (d) => seen.push(d) })
  assert.equal(seen.join(''), '1\n2\n3\n')
})

test('commands: a background process is listed and killed', async () => {
  const h = await sbx.commands.run('sleep 600', { background: true })
  assert.ok(h.pid > 0)
  const listed = await sbx.commands.list()
  assert.ok(listed.some((p) => p.pid === h.pid), JSON.stringify(listed))
  assert.equal(await sbx.commands.kill(h.pid), true)
  await waitUntil(async () => !(await sbx.commands.list()).some((p) => p.pid === h.pid), 'the killed process is gone')
  assert.equal(await sbx.commands.kill(h.pid), false)
})

test('files: write, read, list, exists, remove', async () => {
  await sbx.files.write('/home/user/js/a.txt', 'alpha')
  await sbx.files.write('/home/user/js/b.bin', new Uint8Array([0, 1, 2, 255]).buffer)
  assert.equal(await sbx.files.read('/home/user/js/a.txt'), 'alpha')
  const bytes = await sbx.files.read('/home/user/js/b.bin', { format: 'bytes' })
  assert.deepEqual([...bytes], [0, 1, 2, 255])
  const names = (await sbx.files.list('/home/user/js')).map((e) => e.name).sort()
  assert.deepEqual(names, ['a.txt', 'b.bin'])
  const info = await sbx.files.getInfo('/home/user/js/a.txt')
  assert.equal(info.type, FileType.FILE)
  assert.equal(info.size, 5)
  // Several files in one multipart request.
  await sbx.files.write([
    { path: '/home/user/js/many/1.txt', data: 'one' },
    { path: '/home/user/js/many/2.txt', data: 'two' },
  ])
  assert.equal(await sbx.files.read('/home/user/js/many/2.txt'), 'two')
  await sbx.files.remove('/home/user/js/many')
  assert.equal(await sbx.files.exists('/home/user/js/many'), false)
  await assert.rejects(sbx.files.read('/home/user/js/none'), NotFoundError)
})

test('files: upload and download URLs are signed URLs of the files endpoint', async () => {
  // With one E2B_SANDBOX_URL they carry no routing to the sandbox (as in the Python
  // suite, they are fetched for real only under a domain): checked for form here.
  const path = '/home/user/js/signed.txt'
  for (const [url, op] of [[await sbx.uploadUrl(path), 'write'], [await sbx.downloadUrl(path), 'read']]) {
    const u = new URL(url)
    assert.ok(u.pathname.endsWith('/files'), `${op}: ${url}`)
    assert.equal(u.searchParams.get('path'), path, `${op}: ${url}`)
    // A secured sandbox (the API returned an envd access token) signs its URLs.
    assert.match(u.searchParams.get('signature') ?? '', /^v1_/, `${op}: ${url}`)
  }
})

test('files: a watch sees a file made in the directory', async () => {
  await sbx.files.makeDir('/home/user/watched')
  const events = []
  const handle = await sbx.files.watchDir('/home/user/watched', (e) => events.push(e))
  try {
    await sbx.files.write('/home/user/watched/new.txt', 'x')
    await waitUntil(() => events.some((e) => e.name === 'new.txt'), 'an event for new.txt')
  } finally {
    await handle.stop()
  }
})

test('list: filters by metadata, newest first, pages with a token', async () => {
  const made = []
  try {
    for (let i = 0; i < 3; i++) {
      made.push(await Sandbox.create(TEMPLATE, { timeoutMs: 120_000, metadata: { suite: run, group: 'listed' } }))
    }
    const query = { metadata: { suite: run, group: 'listed' } }
    const all = await Sandbox.list({ query }).nextItems()
    assert.deepEqual(all.map((s) => s.sandboxId), made.map((s) => s.sandboxId).reverse())
    const pages = Sandbox.list({ query, limit: 2 })
    const first = await pages.nextItems()
    assert.equal(first.length, 2)
    assert.equal(pages.hasNext, true)
    const second = await pages.nextItems()
    assert.deepEqual(second.map((s) => s.sandboxId), [made[0].sandboxId])
    assert.equal(pages.hasNext, false)
  } finally {
    for (const s of made) await s.kill()
  }
})

test('pause keeps files, connect resumes', async () => {
  const s = await Sandbox.create(TEMPLATE, { timeoutMs: 120_000, metadata: { suite: run, group: 'pause' } })
  try {
    await s.files.write('/home/user/kept.txt', 'kept')
    assert.equal(await s.pause(), true)
    assert.equal((await Sandbox.getInfo(s.sandboxId)).state, 'paused')
    const again = await Sandbox.connect(s.sandboxId)
    assert.equal((await Sandbox.getInfo(s.sandboxId)).state, 'running')
    assert.equal(await again.files.read('/home/user/kept.txt'), 'kept')
    assert.equal((await again.commands.run('echo back')).stdout, 'back\n')
  } finally {
    await Sandbox.kill(s.sandboxId)
  }
})

test('a pause without memory keeps the files, ends the processes; connect boots it again', async () => {
  const s = await Sandbox.create(TEMPLATE, { timeoutMs: 120_000, metadata: { suite: run, group: 'fs-pause' } })
  try {
    await s.files.write('/home/user/kept.txt', 'kept')
    // Detached, with no stream of the client's open to it (an open stream that breaks
    // would be the next call, and resume the sandbox at once).
    await s.commands.run('sleep 3600 >/dev/null 2>&1 &')
    assert.equal((await s.commands.run('pidof sleep >/dev/null && echo running')).stdout, 'running\n')
    assert.equal(await s.pause({ keepMemory: false }), true)
    assert.equal((await Sandbox.getInfo(s.sandboxId)).state, 'paused')
    const again = await Sandbox.connect(s.sandboxId)
    assert.equal(await again.files.read('/home/user/kept.txt'), 'kept')
    assert.equal((await again.commands.run('pidof sleep || echo gone')).stdout, 'gone\n')
  } finally {
    await Sandbox.kill(s.sandboxId)
  }
})

test('pty: an interactive shell sees its input, resizes and is killed', async () => {
  const s = await Sandbox.create(TEMPLATE, { timeoutMs: 120_000, metadata: { suite: run, group: 'pty' } })
  try {
    const decoder = new TextDecoder()
    let out = ''
    const pty = await s.pty.create({ cols: 80, rows: 24, timeoutMs: 60_000, onData: (d) => { out += decoder.decode(d, { stream: true }) } })
    const type = (line) => s.pty.sendInput(pty.pid, new TextEncoder().encode(line + '\n'))
    await type('echo pty-$((6*7)); tty; stty size')
    await waitUntil(() => out.includes('pty-42') && out.includes('/dev/pts/') && out.includes('24 80'), 'the shell answered on a terminal of 24x80')
    await s.pty.resize(pty.pid, { cols: 132, rows: 50 })
    await type('stty size')
    await waitUntil(() => out.includes('50 132'), 'the terminal resized to 50x132')
    assert.equal(await s.pty.kill(pty.pid), true)
    await assert.rejects(pty.wait())
  } finally {
    await s.kill()
  }
})

test('snapshots: a snapshot starts sandboxes with the files of its moment; listed, then deleted', async () => {
  const parent = await Sandbox.create(TEMPLATE, { timeoutMs: 120_000, metadata: { suite: run, group: 'snap' } })
  try {
    await parent.files.write('/home/user/snap.txt', 'in the snapshot')
    const snap = await parent.createSnapshot()
    assert.ok(snap.snapshotId)
    await parent.files.write('/home/user/after-snap.txt', 'later')
    assert.ok((await parent.listSnapshots().nextItems()).some((x) => x.snapshotId === snap.snapshotId))
    const child = await Sandbox.create(snap.snapshotId, { timeoutMs: 120_000, metadata: { suite: run, group: 'from-snap' } })
    try {
      assert.notEqual(child.sandboxId, parent.sandboxId)
      assert.equal(await child.files.read('/home/user/snap.txt'), 'in the snapshot')
      assert.equal(await child.files.exists('/home/user/after-snap.txt'), false)
      await child.files.write('/home/user/snap.txt', 'changed in the child')
      assert.equal(await parent.files.read('/home/user/snap.txt'), 'in the snapshot')
    } finally {
      await child.kill()
    }
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
  } finally {
    await parent.kill()
  }
})

test('fork: copies start from the parent and then diverge', async () => {
  const parent = await Sandbox.create(TEMPLATE, { timeoutMs: 120_000, metadata: { suite: run, group: 'fork' } })
  try {
    await parent.files.write('/home/user/fork.txt', 'parent')
    const forks = await parent.fork({ count: 2, timeoutMs: 120_000 })
    try {
      assert.equal(forks.length, 2)
      assert.deepEqual(forks.filter((f) => f instanceof Error), [])
      assert.equal(new Set(forks.map((f) => f.sandboxId).concat([parent.sandboxId])).size, 3)
      for (const [i, f] of forks.entries()) {
        assert.equal(await f.files.read('/home/user/fork.txt'), 'parent')
        await f.files.write('/home/user/fork.txt', `fork ${i}`)
      }
      for (const [i, f] of forks.entries()) assert.equal(await f.files.read('/home/user/fork.txt'), `fork ${i}`)
      assert.equal(await parent.files.read('/home/user/fork.txt'), 'parent')
      assert.equal(await parent.isRunning(), true)
    } finally {
      for (const f of forks) if (!(f instanceof Error)) await f.kill()
    }
  } finally {
    await parent.kill()
  }
})

test('git: init, commit, branch, push to a bare remote, clone and pull', async () => {
  const work = '/home/user/js-work'
  const origin = '/home/user/js-origin.git'
  await sbx.git.configureUser('Grace Hopper', 'grace@example.org')
  assert.equal(await sbx.git.getConfig('user.name'), 'Grace Hopper')
  await sbx.git.setConfig('pull.rebase', 'false')
  await sbx.git.init(work, { initialBranch: 'main' })
  await sbx.files.write(`${work}/a.txt`, 'one\n')
  assert.deepEqual((await sbx.git.status(work)).fileStatus.map((f) => f.name), ['a.txt'])
  await sbx.git.add(work)
  await sbx.git.commit(work, 'first')
  assert.equal((await sbx.git.status(work)).fileStatus.length, 0)
  await sbx.git.createBranch(work, 'feature')
  await sbx.git.checkoutBranch(work, 'main')
  assert.deepEqual((await sbx.git.branches(work)).branches.sort(), ['feature', 'main'])
  await sbx.git.deleteBranch(work, 'feature')
  await sbx.files.write(`${work}/a.txt`, 'changed\n')
  await sbx.git.restore(work, { paths: ['a.txt'] })
  assert.equal(await sbx.files.read(`${work}/a.txt`), 'one\n')
  await sbx.git.reset(work, { mode: 'hard' })
  await sbx.git.init(origin, { bare: true, initialBranch: 'main' })
  await sbx.git.remoteAdd(work, 'origin', origin)
  assert.equal(await sbx.git.remoteGet(work, 'origin'), origin)
  await sbx.git.push(work, { remote: 'origin', branch: 'main' })
  await sbx.git.clone(origin, { path: '/home/user/js-copy' })
  await sbx.files.write('/home/user/js-copy/b.txt', 'two\n')
  await sbx.git.add('/home/user/js-copy')
  await sbx.git.commit('/home/user/js-copy', 'second')
  await sbx.git.push('/home/user/js-copy')
  await sbx.git.pull(work, { remote: 'origin', branch: 'main' })
  assert.equal(await sbx.files.read(`${work}/b.txt`), 'two\n')
})

test('kill ends the sandbox; a second kill and a connect say it is gone', async () => {
  const s = await Sandbox.create(TEMPLATE, { timeoutMs: 120_000, metadata: { suite: run, group: 'kill' } })
  assert.equal(await s.kill(), true)
  await waitUntil(async () => !(await s.isRunning()), 'the killed sandbox stopped answering')
  assert.equal(await Sandbox.kill(s.sandboxId), false)
  await assert.rejects(Sandbox.getInfo(s.sandboxId), NotFoundError)
  assert.deepEqual(await Sandbox.list({ query: { metadata: { suite: run, group: 'kill' } } }).nextItems(), [])
})

// The gateway as an MCP client inside the sandbox sees it (the image's FastMCP client):
// the tool names, or the error a wrong token gets. The URL the SDK gives is a host name
// on the TLS port, which the Python suite (test_mcp.py) calls from outside.
const MCP_PROBE = `
import asyncio, os, sys
sys.path.insert(0, "/opt/mcp-gateway/site")
from fastmcp import Client
async def main():
    async with Client("http://127.0.0.1:50005/mcp", auth=os.environ["TOKEN"]) as c:
        print(" ".join(sorted(t.name for t in await c.list_tools())))
asyncio.run(main())
`

test('mcp: create starts the gateway, whose token the SDK gives and which answers only with it', async () => {
  const s = await Sandbox.create({ mcp: { time: {} }, timeoutMs: 120_000, metadata: { suite: run, group: 'mcp' } })
  try {
    assert.equal(s.getMcpUrl(), `https://${s.getHost(50005)}/mcp`)
    const token = await s.getMcpToken()
    assert.match(token, /^[0-9a-f-]{36}$/)
    const again = await Sandbox.connect(s.sandboxId)
    assert.equal(await again.getMcpToken(), token) // read back from the sandbox, as root
    await s.files.write('/tmp/probe.py', MCP_PROBE)
    const listed = await s.commands.run('python3 /tmp/probe.py', { envs: { TOKEN: token } })
    assert.deepEqual(listed.stdout.trim().split(' '), ['convert_time', 'get_current_time'])
    for (const auth of ['', '-H "Authorization: Bearer wrong"']) {
      const refused = await s.commands.run(`curl -s -o /dev/null -w '%{http_code}' -X POST ${auth} http://127.0.0.1:50005/mcp`)
      assert.equal(refused.stdout, '401')
    }
  } finally {
    await s.kill()
  }
  await assert.rejects(
    Sandbox.create({ mcp: { exa: { apiKey: 'unused' } }, timeoutMs: 60_000, metadata: { suite: run, group: 'mcp-bad' } }),
    (e) => /Failed to start MCP gateway/.test(e.message) && /unknown MCP server 'exa'/.test(e.message)
  )
  assert.deepEqual(await Sandbox.list({ query: { metadata: { suite: run, group: 'mcp-bad' } } }).nextItems(), [])
})

test('an unknown template is an error, not a sandbox', async () => {
  await assert.rejects(Sandbox.create('no-such-template-' + run, { timeoutMs: 60_000 }), (e) => e instanceof Error && /no-such-template/.test(e.message))
})

test('the code interpreter package creates through the same API', async () => {
  // Its Sandbox is e2b's with run_code on top; its default template is not installed
  // here, so it is asked for `base` and only the shared API is used.
  const s = await CodeInterpreter.create(TEMPLATE, { timeoutMs: 60_000, metadata: { suite: run, group: 'ci' } })
  try {
    assert.equal((await s.commands.run('echo ci')).stdout, 'ci\n')
  } finally {
    await s.kill()
  }
})

test('runCode on the default template: state, values without quotes, rich results, languages', async () => {
  // No template: the package's own default, code-interpreter-v1. The sandbox's own
  // variables reach its kernels, started before it or not.
  const s = await CodeInterpreter.create({ timeoutMs: 120_000, envs: { TASK_ID: 'js-task' }, metadata: { suite: run, group: 'run-code' } })
  try {
    assert.equal((await s.runCode("import os\nos.environ['TASK_ID']")).text, 'js-task')
    assert.equal((await s.runCode('process.env.TASK_ID', { language: 'javascript' })).text, 'js-task')
    await s.runCode('x = 41')
    const value = await s.runCode('x + 1')
    assert.equal(value.text, '42')
    assert.equal((await s.runCode("import os\nos.environ['FOO']", { envs: { FOO: 'bar' } })).text, 'bar')
    const results = []
    const frame = await s.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2]})", { onResult: (r) => results.push(r) })
    assert.deepEqual(frame.results[0].data, { a: [1, 2] })
    assert.match(frame.results[0].html, /<table/)
    assert.equal(results.length, 1)
    const plot = await s.runCode("import matplotlib.pyplot as plt\nplt.plot([1, 2], [3, 4])\nplt.title('t')\nplt.show()")
    assert.ok(Buffer.from(plot.results[0].png, 'base64').subarray(0, 4).equals(Buffer.from([0x89, 0x50, 0x4e, 0x47])))
    assert.equal(plot.results[0].chart.type, 'line')
    assert.equal(plot.results[0].chart.title, 't')
    assert.equal((await s.runCode("'a' + 'b'", { language: 'javascript' })).text, 'ab')
    const failed = await s.runCode('1 / 0')
    assert.equal(failed.error.name, 'ZeroDivisionError')
    // Java runs on its own kernel (the JVM's first start takes a second or two).
    assert.equal((await s.runCode('int n = 6; n * 7', { language: 'java' })).text, '42')
    // A language the sandbox lacks is a 400 (the JS SDK's message shows the status only).
    await assert.rejects(s.runCode('1', { language: 'cobol' }), (e) => /400/.test(e.message))
  } finally {
    await s.kill()
  }
})
