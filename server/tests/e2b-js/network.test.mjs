// Specification: network egress through the unmodified E2B JS SDK. server/tests/e2b_js.rs
// (`e2b_js_network`) runs this module against an `opendsec up` inside a test internet of
// its own (server/tests/support/internet.rs): `pkgs.test` (11.0.0.10) and `other.test`
// (11.0.0.20) answer HTTP with `hello from <address> <port> for <client>`, and a SOCKS5
// proxy (microsocks) listens at 11.0.0.80:1080. No packet leaves the test's namespaces.
// OpenDsec's default is deny (E2B's is open): code that needs the network says so.

import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { Sandbox, CommandExitError } from 'e2b'

const TEMPLATE = 'base'
const PKGS = '11.0.0.10'
const OTHER = '11.0.0.20'
const SOCKS = '11.0.0.80'
// The client a server sees when no proxy carried the connection: the edge.
const EDGE = '10.200.0.2'
const run = randomUUID().slice(0, 12)
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const made = []

async function create(opts) {
  const sbx = await Sandbox.create(TEMPLATE, { timeoutMs: 300_000, metadata: { suite: run }, ...opts })
  made.push(sbx)
  return sbx
}

after(async () => {
  for (const s of made) await s.kill()
})

// GET `url` from inside the sandbox (3 s at most): the body, or null.
async function fetchIn(sbx, url) {
  try {
    return (await sbx.commands.run(`curl -sS -m 3 ${url}`, { timeoutMs: 15_000 })).stdout
  } catch (e) {
    if (e instanceof CommandExitError) return null
    throw e
  }
}

async function waitUntil(probe, what, withinMs = 15000) {
  const deadline = Date.now() + withinMs
  for (;;) {
    if (await probe()) return
    if (Date.now() > deadline) assert.fail(`${what}: not within ${withinMs} ms`)
    await sleep(200)
  }
}

test('allowInternetAccess false reaches nothing; true the public internet and never the metadata address', async () => {
  const closed = await create({ allowInternetAccess: false })
  const opened = await create({ allowInternetAccess: true })
  assert.equal(await fetchIn(closed, 'http://pkgs.test/'), null)
  assert.equal(await fetchIn(closed, `http://${PKGS}/`), null)
  assert.match((await fetchIn(opened, 'http://other.test:8080/')) ?? '', new RegExp(`hello from ${OTHER} 8080`))
  assert.equal(await fetchIn(opened, 'http://169.254.169.254/'), null)
})

test('allowOut opens a name and nothing else, and updateNetwork changes it while it runs', async () => {
  const sbx = await create({ network: { allowOut: ['pkgs.test'] } })
  assert.match((await fetchIn(sbx, 'http://pkgs.test/')) ?? '', new RegExp(`hello from ${PKGS} 80`))
  assert.equal(await fetchIn(sbx, `http://${OTHER}/`), null)
  await sbx.updateNetwork({ allowOut: ['other.test'] })
  await waitUntil(async () => (await fetchIn(sbx, 'http://other.test/'))?.includes(`hello from ${OTHER} 80`), 'other.test given')
  assert.equal(await fetchIn(sbx, 'http://pkgs.test/'), null)
})

test('an egressProxy carries what the policy allows; its password is never shown; an update without it goes straight', async () => {
  const sbx = await create({
    network: { allowOut: ['pkgs.test'], egressProxy: { address: `${SOCKS}:1080`, username: 'odsec', password: 'proxy-pw' } },
  })
  assert.match((await fetchIn(sbx, 'http://pkgs.test/')) ?? '', new RegExp(`hello from ${PKGS} 80 for ${SOCKS}`))
  assert.equal(await fetchIn(sbx, `http://${OTHER}/`), null)
  const info = await sbx.getInfo()
  assert.equal(info.network?.egressProxy?.address, `${SOCKS}:1080`)
  assert.ok(!JSON.stringify(info).includes('proxy-pw'))
  await sbx.updateNetwork({ allowOut: ['pkgs.test'] })
  await waitUntil(async () => (await fetchIn(sbx, 'http://pkgs.test/'))?.includes(`for ${EDGE}`), 'straight out without the proxy')
})
