//! Sampled drops: what a sandbox tried to reach and its policy refused, so its owner can
//! see why `pip` failed. Each dropping rule of a sandbox's chain is preceded by one that
//! logs the first packet of new connections it is about to drop, rate-limited
//! (`rules::logged_drop`), with the prefix `odsec-drop <table> sb<slot> <rule>: `. A
//! thread follows `/dev/kmsg` and keeps the last [`KEPT`] drops of each slot of this
//! edge's table. Where the kernel log cannot be read, drops are still counted (the
//! chain's counter), not sampled. An edge in a network namespace other than the host's
//! is logged only where `net.netfilter.nf_log_all_netns` is 1.

use super::rules::DROP_LOG_TAG;
use std::collections::{BTreeMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Drops kept per sandbox.
pub const KEPT: usize = 20;

/// One sampled drop.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Drop {
    /// When the kernel logged it (ms since the Unix epoch, as this edge read it).
    pub at_ms: u64,
    /// `tcp`, `udp`, `icmp`, ... as the kernel names it, lower case.
    pub protocol: String,
    pub destination: IpAddr,
    /// The destination port (absent for protocols without ports).
    pub port: Option<u16>,
    /// The rule that dropped it: `deny_out` (a deny rule) or `default` (nothing allowed it).
    pub rule: String,
    /// Packets logged for it (a connection's retried SYNs come within [`SAME_WINDOW_MS`]
    /// of the first and count here).
    pub packets: u32,
}

/// Drops of the same destination, port, protocol and rule this close after the last are
/// counted in it, not kept apart.
pub const SAME_WINDOW_MS: u64 = 5_000;

/// The last drops of each slot of one table.
pub struct DropLog {
    table: String,
    by_slot: Mutex<BTreeMap<u32, VecDeque<Drop>>>,
}

impl DropLog {
    /// Follows the kernel log for drops of `table`; an edge that cannot read it says so
    /// once and gets an empty log.
    pub fn follow(table: &str) -> Arc<DropLog> {
        let log = Arc::new(DropLog {
            table: table.to_string(),
            by_slot: Mutex::new(BTreeMap::new()),
        });
        let take = |log: &DropLog, record: &str| {
            if let Some((_, text)) = record.split_once(';') {
                log.take(text.trim_end(), opendsec_edge_api::now_ms());
            }
        };
        if let Err(e) = crate::kmsg::follow("drop-log", &log, take) {
            tracing::warn!(error = %e, "cannot follow /dev/kmsg: sandboxes' drops are counted, not sampled");
        }
        log
    }

    /// The last drops of slot `slot`, oldest first.
    pub fn of(&self, slot: u32) -> Vec<Drop> {
        self.by_slot
            .lock()
            .expect("drop log lock")
            .get(&slot)
            .map(|d| d.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Forgets slot `slot` (its sandbox is gone; the slot may be handed out again).
    pub fn forget(&self, slot: u32) {
        self.by_slot.lock().expect("drop log lock").remove(&slot);
    }

    /// Takes in one kernel log record (its text after the `;`), if it is one of ours.
    pub fn take(&self, text: &str, at_ms: u64) {
        if let Some((slot, drop)) = parse(&self.table, text, at_ms) {
            let mut all = self.by_slot.lock().expect("drop log lock");
            let kept = all.entry(slot).or_default();
            if let Some(last) = kept.back_mut()
                && (&last.protocol, last.destination, last.port, &last.rule)
                    == (&drop.protocol, drop.destination, drop.port, &drop.rule)
                && drop.at_ms.saturating_sub(last.at_ms) < SAME_WINDOW_MS
            {
                last.packets += 1;
                return;
            }
            if kept.len() == KEPT {
                kept.pop_front();
            }
            kept.push_back(drop);
        }
    }
}

/// A drop of `table` in a kernel log line: `odsec-drop <table> sb<slot> <rule>: IN=...
/// DST=<addr> ... PROTO=<proto> SPT=.. DPT=<port> ...`.
pub fn parse(table: &str, text: &str, at_ms: u64) -> Option<(u32, Drop)> {
    let rest = text.strip_prefix(DROP_LOG_TAG)?.strip_prefix(' ')?;
    let rest = rest.strip_prefix(table)?.strip_prefix(" sb")?;
    let (slot, rest) = rest.split_once(' ')?;
    let (rule, fields) = rest.split_once(": ")?;
    let field = |name: &str| {
        fields
            .split_whitespace()
            .find_map(|f| f.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
    };
    Some((
        slot.parse().ok()?,
        Drop {
            at_ms,
            protocol: field("PROTO").unwrap_or("ip").to_ascii_lowercase(),
            destination: field("DST")?.parse().ok()?,
            port: field("DPT").and_then(|p| p.parse().ok()),
            rule: rule.to_string(),
            packets: 1,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_logged_drop_names_its_sandboxs_slot_destination_port_and_rule() {
        let line = "odsec-drop opendsec_e1_abc12 sb7 default: IN=odabc127 OUT=up0 MAC=aa SRC=10.231.0.7 \
                    DST=11.0.0.20 LEN=60 TOS=0x00 PREC=0x00 TTL=63 ID=1 DF PROTO=TCP SPT=40000 DPT=443 WINDOW=1 SYN";
        let (slot, d) = parse("opendsec_e1_abc12", line, 5).unwrap();
        assert_eq!(slot, 7);
        assert_eq!(
            d,
            Drop {
                at_ms: 5,
                protocol: "tcp".into(),
                destination: "11.0.0.20".parse().unwrap(),
                port: Some(443),
                rule: "default".into(),
                packets: 1,
            }
        );
        let v6 = "odsec-drop opendsec_e1_abc12 sb7 deny_out: IN=x OUT=y SRC=fd6f::7 DST=2a0a::20 LEN=80 PROTO=UDP SPT=1 DPT=53 LEN=8";
        assert_eq!(parse("opendsec_e1_abc12", v6, 0).unwrap().1.port, Some(53));
        // Another edge's table, or not a drop at all.
        assert_eq!(parse("opendsec_e1_abc1", line, 0), None);
        assert_eq!(parse("opendsec_e1_abc12", "oom-kill: task=x", 0), None);
    }

    #[test]
    fn a_slot_keeps_its_last_drops_and_forgets_them_when_it_is_freed() {
        let log = DropLog {
            table: "t".into(),
            by_slot: Mutex::new(BTreeMap::new()),
        };
        for port in 0..(KEPT as u16 + 5) {
            log.take(
                &format!("odsec-drop t sb3 default: DST=11.0.0.1 PROTO=TCP DPT={port}"),
                0,
            );
        }
        let kept = log.of(3);
        assert_eq!(kept.len(), KEPT);
        assert_eq!(kept[0].port, Some(5), "the oldest went first");
        // A connection's retried SYNs count in its one entry.
        log.take("odsec-drop t sb3 default: DST=11.0.0.1 PROTO=TCP DPT=99", 1000);
        log.take("odsec-drop t sb3 default: DST=11.0.0.1 PROTO=TCP DPT=99", 2000);
        log.take("odsec-drop t sb3 default: DST=11.0.0.1 PROTO=TCP DPT=99", 9000);
        let kept = log.of(3);
        assert_eq!(kept[KEPT - 2].packets, 2);
        assert_eq!((kept[KEPT - 1].port, kept[KEPT - 1].packets), (Some(99), 1));
        log.forget(3);
        assert!(log.of(3).is_empty());
    }
}
