//! Policy update to enforcement: how long after `PUT /v1/sandboxes/{id}/network` is
//! sent the sandbox's data path obeys the new policy, both ways.
//!
//! The probe sandbox's policy alternates between allowing [`TARGET`] (`{"allow_out":
//! ["11.0.0.10"]}`) and nothing (`{"allow_out": []}`), `runs` times each way after one
//! warm-up pair. For each update a thread of the bench joins the sandbox's network
//! namespace and, from there, starts a non-blocking TCP connect to
//! [`TARGET`]`:`[`CONNECT_PORT`] every [`EVERY`] (each given [`TIMEOUT`] to complete;
//! the policy refuses at once, ICMP admin-prohibited, so a refused connect fails with
//! "No route to host"; one that has not completed by then counts as refused too). Allow ->
//! deny also keeps a connection to the echo port open, opened while allowed, and sends
//! it one byte every [`EVERY`]. The thread tells the bench when its last [`SETTLED`]
//! attempts (and echoes) show the old policy; the clock starts just before the PUT is
//! sent, and the thread goes on until the new policy has held for [`SETTLED`] attempts
//! (and, allow -> deny, no echo has come for 300 ms).
//!
//! What is read off, from the PUT's start:
//! - new connections: the start of the first attempt from which on every attempt shows
//!   the new policy (a connect that passed is one whose SYN passed, so the new policy
//!   was in force between the attempt before it and it: the figure is within
//!   [`EVERY`] of the moment, and a single slow or lucky attempt cannot move it);
//! - allow -> deny, the open connection: when the first byte that never came back was
//!   sent (its packet was the first the new chain refused).
//!
//! Allow -> deny's figure is the later of the two (both had stopped), deny -> allow's
//! the first. The PUT's own answer time is kept beside them.

use std::io::{Read, Write};
use std::net::{SocketAddrV4, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::internet::{CONNECT_PORT, ECHO_PORT, TARGET, connect};
use super::netns::run_in_async;
use super::sandbox::Probe;
use crate::sandboxes::UpGuard;

/// A new connect attempt (and echo byte) every this long.
const EVERY: Duration = Duration::from_millis(1);
/// A connect that has not completed in this long was refused (the policy's reject lost,
/// or a drop).
const TIMEOUT: Duration = Duration::from_millis(20);
/// Attempts in a row that make a state settled.
const SETTLED: usize = 20;
/// How long after the PUT the new policy must be seen.
const GIVE_UP: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Way {
    AllowToDeny,
    DenyToAllow,
}

/// One update, each figure from just before the PUT was sent.
#[derive(Clone, Debug)]
pub(super) struct Update {
    /// The first attempt from which on every new connect obeyed the new policy.
    pub(super) connects: Duration,
    /// Allow -> deny: the first byte over the open connection that never came back.
    pub(super) open_connection: Option<Duration>,
    /// The PUT's answer (200) arrived.
    pub(super) put_answered: Duration,
    /// Attempts after the PUT that showed the new policy before it held (noise).
    pub(super) early: usize,
}

impl Update {
    /// The figure: when the data path obeyed the new policy in every way measured.
    pub(super) fn enforced(&self) -> Duration {
        self.open_connection.map_or(self.connects, |o| o.max(self.connects))
    }
}

#[derive(Default)]
pub(super) struct Enforcement {
    pub(super) allow_to_deny: Vec<Update>,
    pub(super) deny_to_allow: Vec<Update>,
    pub(super) errors: Vec<String>,
}

/// The policy that allows the target, and the one that allows nothing.
pub(super) fn allow_policy() -> Value {
    json!({"allow_out": [TARGET.to_string()]})
}

fn deny_policy() -> Value {
    json!({"allow_out": []})
}

/// `runs` updates each way (after one warm-up pair), starting from the allow policy
/// (the probe's at creation); ends on it too.
pub(super) async fn measure(up: &UpGuard, probe: &Probe, runs: usize) -> Enforcement {
    let mut e = Enforcement::default();
    for i in 0..=runs {
        for way in [Way::AllowToDeny, Way::DenyToAllow] {
            match update(up, probe, way).await {
                Ok(u) if i > 0 => match way {
                    Way::AllowToDeny => e.allow_to_deny.push(u),
                    Way::DenyToAllow => e.deny_to_allow.push(u),
                },
                Ok(_) => {}
                Err(err) => {
                    e.errors.push(format!("{way:?}, run {i}: {err}"));
                    // Back to the allow policy, the start of every pair.
                    let _ = probe.set_policy(up, &allow_policy()).await;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    break;
                }
            }
        }
        if e.errors.len() > 5 {
            break;
        }
    }
    e
}

/// One update `way`: the probe thread, the PUT, what the thread saw.
async fn update(up: &UpGuard, probe: &Probe, way: Way) -> Result<Update, String> {
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<Result<(), String>>();
    let (t0_tx, t0_rx) = mpsc::channel::<Instant>();
    let old_ok = way == Way::AllowToDeny;
    let ns = probe.netns.clone();
    let thread = tokio::spawn(async move { run_in_async(&ns, move || watch(old_ok, old_ok, ready_tx, t0_rx)).await });
    match ready_rx.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(format!("before the update: {e}")),
        Err(_) => {
            return Err(match thread.await {
                Ok(Ok(Err(e))) | Ok(Err(e)) => format!("before the update: {e}"),
                _ => "the probe thread ended before the update".into(),
            });
        }
    }
    let policy = if old_ok { deny_policy() } else { allow_policy() };
    let t0 = Instant::now();
    let put = probe.set_policy(up, &policy).await;
    let put_answered = t0.elapsed();
    let _ = t0_tx.send(t0);
    let trace = thread.await.map_err(|e| format!("the probe thread: {e}"))???;
    put?;
    trace.read(t0, !old_ok, put_answered)
}

/// One connect attempt: when it started and whether it connected.
#[derive(Clone, Copy)]
struct Attempt {
    start: Instant,
    ok: bool,
}

/// What the probe thread saw.
struct Trace {
    attempts: Vec<Attempt>,
    /// When each echo byte was sent, and how many came back.
    sends: Vec<Instant>,
    echoed: usize,
    echo: bool,
}

impl Trace {
    /// The figures of an update whose PUT started at `t0` toward `new_ok`.
    fn read(mut self, t0: Instant, new_ok: bool, put_answered: Duration) -> Result<Update, String> {
        self.attempts.sort_by_key(|a| a.start);
        let from = held_from(&self.attempts, new_ok).ok_or("the new policy never held")?;
        let start = self.attempts[from].start;
        if start < t0 {
            return Err("the new policy was in force before the PUT was sent".into());
        }
        let early = self.attempts[..from]
            .iter()
            .filter(|a| a.start >= t0 && a.ok == new_ok)
            .count();
        let open_connection = if self.echo {
            let first_lost = *self.sends.get(self.echoed).ok_or("every echo byte came back")?;
            if first_lost < t0 {
                return Err("the open connection stopped before the PUT was sent".into());
            }
            Some(first_lost - t0)
        } else {
            None
        };
        Ok(Update {
            connects: start - t0,
            open_connection,
            put_answered,
            early,
        })
    }
}

/// The first index from which on every attempt (sorted by start) has `ok == want`.
fn held_from(sorted: &[Attempt], want: bool) -> Option<usize> {
    let from = sorted.iter().rposition(|a| a.ok != want).map_or(0, |i| i + 1);
    (from < sorted.len()).then_some(from)
}

/// Whether the last [`SETTLED`] attempts (by start) all have `ok == want`.
fn settled(attempts: &[Attempt], want: bool, after: Option<Instant>) -> bool {
    let mut v: Vec<&Attempt> = attempts.iter().filter(|a| after.is_none_or(|t| a.start >= t)).collect();
    v.sort_by_key(|a| a.start);
    v.len() >= SETTLED && v[v.len() - SETTLED..].iter().all(|a| a.ok == want)
}

/// A non-blocking connect to `addr` from this thread's namespace.
fn start_connect(addr: SocketAddrV4) -> Result<OwnedFd, String> {
    // SAFETY: plain syscalls on a descriptor this function owns.
    unsafe {
        let fd = libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        );
        if fd < 0 {
            return Err(format!("socket: {}", std::io::Error::last_os_error()));
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: addr.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*addr.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        let r = libc::connect(
            fd.as_raw_fd(),
            &sa as *const libc::sockaddr_in as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        let err = std::io::Error::last_os_error();
        if r == 0 || err.raw_os_error() == Some(libc::EINPROGRESS) {
            Ok(fd)
        } else {
            Err(format!("connect {addr}: {err}"))
        }
    }
}

/// Whether a connect that polled ready succeeded; closes it with a reset either way (no
/// TIME_WAIT left for thousands of probes).
fn finish(fd: OwnedFd) -> bool {
    let mut err: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: getsockopt/setsockopt on a descriptor we own, into locals of the right size.
    unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            &mut err as *mut libc::c_int as *mut libc::c_void,
            &mut len,
        );
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &linger as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    err == 0
}

/// The probe loop, on a thread inside the sandbox's namespace: connect attempts every
/// [`EVERY`] (and, with `echo`, a byte over an open connection), `ready` once the old
/// state (`old_ok`) has settled, until the new one has held after the PUT's start
/// (received on `t0`).
fn watch(
    old_ok: bool,
    echo: bool,
    ready: tokio::sync::oneshot::Sender<Result<(), String>>,
    t0: mpsc::Receiver<Instant>,
) -> Result<Trace, String> {
    let mut ready = Some(ready);
    let fail = |ready: &mut Option<tokio::sync::oneshot::Sender<Result<(), String>>>, e: String| {
        if let Some(r) = ready.take() {
            let _ = r.send(Err(e.clone()));
        }
        Err(e)
    };
    let mut stream: Option<TcpStream> = None;
    if echo {
        let s = match connect(SocketAddrV4::new(TARGET, ECHO_PORT), Duration::from_secs(2)) {
            Ok(s) => s,
            Err(e) => return fail(&mut ready, format!("the open connection: {e}")),
        };
        let _ = s.set_nodelay(true);
        let _ = s.set_nonblocking(true);
        stream = Some(s);
    }
    let target = SocketAddrV4::new(TARGET, CONNECT_PORT);
    let began = Instant::now();
    let mut trace = Trace {
        attempts: Vec::new(),
        sends: Vec::new(),
        echoed: 0,
        echo,
    };
    let mut inflight: Vec<(OwnedFd, Instant)> = Vec::new();
    let mut next = Instant::now();
    let mut last_echo = Instant::now();
    let mut put: Option<Instant> = None;
    let mut checked = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        let now = Instant::now();
        if now >= next {
            match start_connect(target) {
                Ok(fd) => inflight.push((fd, now)),
                Err(e) => return fail(&mut ready, e),
            }
            if let Some(s) = stream.as_mut()
                && let Ok(1) = s.write(b"x")
            {
                trace.sends.push(now);
            }
            next += EVERY;
            if next < now {
                next = now + EVERY;
            }
        }
        // Wait for a connect to complete, an echo, or the next attempt.
        let mut fds: Vec<libc::pollfd> = inflight
            .iter()
            .map(|(fd, _)| libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLOUT,
                revents: 0,
            })
            .collect();
        if let Some(s) = &stream {
            fds.push(libc::pollfd {
                fd: s.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let wait = next.saturating_duration_since(Instant::now());
        let ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: wait.as_nanos().min(999_999_999) as libc::c_long,
        };
        // SAFETY: ppoll over descriptors that live through the call.
        unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
        let now = Instant::now();
        let mut still = Vec::with_capacity(inflight.len());
        for ((fd, start), p) in inflight.drain(..).zip(&fds) {
            if p.revents != 0 {
                trace.attempts.push(Attempt { start, ok: finish(fd) });
            } else if now - start >= TIMEOUT {
                trace.attempts.push(Attempt { start, ok: false });
            } else {
                still.push((fd, start));
            }
        }
        inflight = still;
        if let Some(s) = stream.as_mut() {
            loop {
                match s.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        trace.echoed += n;
                        last_echo = now;
                    }
                    Err(_) => break,
                }
            }
        }
        if put.is_none() {
            put = t0.try_recv().ok();
        }
        // The state checks sort the attempts: every 5 ms is enough.
        if now - checked < Duration::from_millis(5) {
            continue;
        }
        checked = now;
        match put {
            None if ready.is_some() => {
                let echo_flows = !echo || (trace.echoed >= 10 && trace.sends.len() - trace.echoed <= 5);
                if settled(&trace.attempts, old_ok, None) && echo_flows {
                    let _ = ready.take().expect("ready").send(Ok(()));
                } else if now - began > GIVE_UP {
                    return fail(
                        &mut ready,
                        format!(
                            "the old policy did not hold for {SETTLED} connects in a row within {GIVE_UP:?} (echoed {} of {})",
                            trace.echoed,
                            trace.sends.len()
                        ),
                    );
                }
            }
            None => {
                if now - began > 2 * GIVE_UP {
                    return Err("the PUT's start never came".into());
                }
            }
            Some(t0) => {
                let stopped =
                    !echo || (trace.echoed < trace.sends.len() && now - last_echo > Duration::from_millis(300));
                if settled(&trace.attempts, !old_ok, Some(t0)) && stopped {
                    return Ok(trace);
                }
                if now - t0 > GIVE_UP {
                    return Err(format!(
                        "the new policy was not seen within {GIVE_UP:?} of the PUT (connects settled: {}, open connection stopped: {stopped})",
                        settled(&trace.attempts, !old_ok, Some(t0))
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_new_policy_holds_from_the_first_attempt_after_the_last_old_one() {
        let t = Instant::now();
        let at = |ms: u64, ok: bool| Attempt {
            start: t + Duration::from_millis(ms),
            ok,
        };
        // A lucky early "new" result (2) does not count: the old one came back at 3.
        let v = [
            at(0, true),
            at(1, true),
            at(2, false),
            at(3, true),
            at(4, false),
            at(5, false),
        ];
        assert_eq!(held_from(&v, false), Some(4));
        assert_eq!(held_from(&v, true), None);
        assert_eq!(held_from(&[at(0, false)], false), Some(0));
    }

    #[test]
    fn an_update_reads_its_figures_from_the_put() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let trace = Trace {
            attempts: vec![
                Attempt { start: at(0), ok: true },
                Attempt {
                    start: at(7),
                    ok: false,
                },
                Attempt { start: at(5), ok: true },
                Attempt {
                    start: at(8),
                    ok: false,
                },
            ],
            sends: vec![at(0), at(4), at(6), at(9)],
            echoed: 2,
            echo: true,
        };
        let u = trace.read(t0, false, Duration::from_millis(3)).unwrap();
        assert_eq!(u.connects, Duration::from_millis(7));
        assert_eq!(u.open_connection, Some(Duration::from_millis(6)));
        assert_eq!(u.enforced(), Duration::from_millis(7));
    }
}
