//! A sandbox's lifecycle, defined once: what its desired state, its observed state and
//! its timeout become on each event about it. The control plane's views (`state`) and an
//! edge's desired state both fold sandboxes through [`Lifecycle::next`], so they cannot
//! disagree about where a sandbox is.

use crate::schema::Event;
use crate::views::{Desired, Observed};

/// The part of a sandbox that its lifecycle events move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifecycle {
    pub desired: Desired,
    /// What the log records its edge last reported.
    pub observed: Observed,
    /// When it times out (killed, or paused with auto-pause); `None`: never.
    pub expires_at_ms: Option<u64>,
    /// Its pause keeps only its file system: paused, its processes are gone, and its
    /// resume boots it again from that file system. Set by a file-system-only pause (asked,
    /// or an auto-pause so configured) and by a resume that drops the memory a pause kept;
    /// cleared by a pause that keeps memory.
    pub filesystem: bool,
}

impl Lifecycle {
    /// A sandbox just created: wanted running, not reported yet. `expires_at_ms` is the
    /// event's field (0: no timeout).
    pub fn created(expires_at_ms: u64) -> Lifecycle {
        Lifecycle {
            desired: Desired::Running,
            observed: Observed::Pending,
            expires_at_ms: (expires_at_ms != 0).then_some(expires_at_ms),
            filesystem: false,
        }
    }

    /// Its end is decided (killed) or recorded (failed, exited): its quota and edge
    /// capacity are given back, and a later report of it running or paused is stale.
    /// **Invariant:** once released, always released.
    pub fn is_released(&self) -> bool {
        self.desired == Desired::Killed || self.has_ended()
    }

    /// The log records an end for it (failed or exited).
    pub fn has_ended(&self) -> bool {
        matches!(self.observed, Observed::Failed | Observed::Exited)
    }

    /// The lifecycle after `ev`, an event about this sandbox; `None` when `ev` is no
    /// transition of it (another kind of event, or one its state rules out: a pause
    /// requested of a sandbox that is not running, a report of a released one running).
    pub fn next(&self, ev: &Event) -> Option<Lifecycle> {
        let mut n = *self;
        match ev {
            Event::SandboxPauseRequested(e) if self.desired == Desired::Running => {
                n.desired = Desired::Paused;
                n.filesystem = e.filesystem;
            }
            Event::SandboxResumeRequested(e) if self.desired == Desired::Paused => {
                n.desired = Desired::Running;
                n.filesystem |= e.cold;
            }
            // Whatever it was doing, it is to end; a second kill changes nothing more.
            Event::SandboxKillRequested(_) => n.desired = Desired::Killed,
            Event::SandboxTimeoutSet(e) => n.expires_at_ms = (e.expires_at_ms != 0).then_some(e.expires_at_ms),
            // Past its timeout with auto-pause: it pauses, and its timeout is spent.
            Event::SandboxTimedOut(e) => {
                n.expires_at_ms = None;
                if self.desired == Desired::Running {
                    n.desired = Desired::Paused;
                    n.filesystem = e.filesystem;
                }
            }
            Event::SandboxReady(_) | Event::SandboxResumed(_) if !self.is_released() => n.observed = Observed::Ready,
            Event::SandboxPaused(_) if !self.is_released() => n.observed = Observed::Paused,
            // An end is recorded even after another (a failure found after an exit).
            Event::SandboxFailed(_) => n.observed = Observed::Failed,
            Event::SandboxExited(_) => n.observed = Observed::Exited,
            _ => return None,
        }
        Some(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb;

    fn id() -> String {
        "sb".into()
    }
    fn pause() -> Event {
        Event::SandboxPauseRequested(pb::SandboxPauseRequested {
            id: id(),
            filesystem: false,
        })
    }
    fn pause_filesystem() -> Event {
        Event::SandboxPauseRequested(pb::SandboxPauseRequested {
            id: id(),
            filesystem: true,
        })
    }
    fn resume() -> Event {
        Event::SandboxResumeRequested(pb::SandboxResumeRequested { id: id(), cold: false })
    }
    fn resume_cold() -> Event {
        Event::SandboxResumeRequested(pb::SandboxResumeRequested { id: id(), cold: true })
    }
    fn kill() -> Event {
        Event::SandboxKillRequested(pb::SandboxKillRequested {
            id: id(),
            reason: "user".into(),
        })
    }
    fn ready() -> Event {
        Event::SandboxReady(pb::SandboxReady {
            id: id(),
            ..Default::default()
        })
    }
    fn paused() -> Event {
        Event::SandboxPaused(pb::SandboxPaused { id: id() })
    }
    fn exited() -> Event {
        Event::SandboxExited(pb::SandboxExited {
            id: id(),
            ..Default::default()
        })
    }
    fn failed() -> Event {
        Event::SandboxFailed(pb::SandboxFailed {
            id: id(),
            reason: "lost".into(),
        })
    }
    fn timed_out() -> Event {
        Event::SandboxTimedOut(pb::SandboxTimedOut {
            id: id(),
            filesystem: false,
        })
    }

    fn through(events: &[Event]) -> Lifecycle {
        events
            .iter()
            .fold(Lifecycle::created(0), |l, ev| l.next(ev).unwrap_or(l))
    }

    #[test]
    fn a_created_sandbox_is_wanted_running_and_not_reported_yet() {
        let l = Lifecycle::created(5_000);
        assert_eq!(
            (l.desired, l.observed, l.expires_at_ms),
            (Desired::Running, Observed::Pending, Some(5_000))
        );
        assert_eq!(Lifecycle::created(0).expires_at_ms, None);
        assert!(!l.is_released());
    }

    #[test]
    fn pause_and_resume_requests_flip_only_what_they_apply_to() {
        assert_eq!(through(&[pause()]).desired, Desired::Paused);
        assert_eq!(through(&[pause(), resume()]).desired, Desired::Running);
        // Resuming a running sandbox, or pausing a killed one, is no transition.
        assert_eq!(Lifecycle::created(0).next(&resume()), None);
        assert_eq!(through(&[kill()]).next(&pause()), None);
        assert_eq!(through(&[kill(), resume()]).desired, Desired::Killed);
    }

    #[test]
    fn reports_move_the_observed_state_until_the_sandbox_is_released() {
        assert_eq!(through(&[ready()]).observed, Observed::Ready);
        assert_eq!(through(&[ready(), paused()]).observed, Observed::Paused);
        // Killed: a late report of it running is stale; only its end is recorded.
        assert_eq!(through(&[kill()]).next(&ready()), None);
        assert_eq!(through(&[ready(), kill(), paused()]).observed, Observed::Ready);
        assert_eq!(through(&[ready(), kill(), exited()]).observed, Observed::Exited);
        // Ended: it stays ended, though a failure found later is recorded.
        assert_eq!(through(&[exited(), ready()]).observed, Observed::Exited);
        assert_eq!(through(&[exited(), failed()]).observed, Observed::Failed);
    }

    #[test]
    fn released_is_for_ever() {
        for end in [kill(), exited(), failed()] {
            let l = through(&[ready(), end]);
            assert!(l.is_released());
            for ev in [
                pause(),
                resume(),
                ready(),
                paused(),
                timed_out(),
                kill(),
                exited(),
                failed(),
            ] {
                assert!(l.next(&ev).unwrap_or(l).is_released(), "{ev:?}");
            }
        }
    }

    #[test]
    fn timing_out_spends_the_timeout_and_pauses_a_running_sandbox_only() {
        let l = Lifecycle::created(5_000);
        let t = l.next(&timed_out()).unwrap();
        assert_eq!((t.desired, t.expires_at_ms), (Desired::Paused, None));
        let killed = l.next(&kill()).unwrap().next(&timed_out()).unwrap();
        assert_eq!((killed.desired, killed.expires_at_ms), (Desired::Killed, None));
        let set = Event::SandboxTimeoutSet(pb::SandboxTimeoutSet {
            id: id(),
            expires_at_ms: 9_000,
        });
        assert_eq!(l.next(&set).unwrap().expires_at_ms, Some(9_000));
    }

    #[test]
    fn a_pause_says_whether_memory_is_kept_and_a_cold_resume_drops_it() {
        assert!(!through(&[pause()]).filesystem);
        assert!(through(&[pause_filesystem()]).filesystem);
        // It resumes by booting again: still so until a pause that keeps memory.
        assert!(through(&[pause_filesystem(), resume()]).filesystem);
        assert!(!through(&[pause_filesystem(), resume(), pause()]).filesystem);
        // A resume that drops the memory a pause kept.
        assert!(through(&[pause(), resume_cold()]).filesystem);
        assert!(!through(&[pause(), resume()]).filesystem);
        // A pause asked of a paused sandbox changes nothing, its mode included.
        assert_eq!(through(&[pause()]).next(&pause_filesystem()), None);
        let auto = Event::SandboxTimedOut(pb::SandboxTimedOut {
            id: id(),
            filesystem: true,
        });
        assert!(Lifecycle::created(5_000).next(&auto).unwrap().filesystem);
    }

    #[test]
    fn events_that_are_not_about_the_lifecycle_are_no_transition() {
        let labels = Event::SandboxLabelsSet(pb::SandboxLabelsSet {
            id: id(),
            labels: Default::default(),
        });
        assert_eq!(Lifecycle::created(0).next(&labels), None);
    }
}
