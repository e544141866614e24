//! Throughput through the policy beside the raw veth path: `iperf3 -c` [`IPERF`]
//! (TCP, one stream, `-t` seconds; then `-R`, the server sending) run by `ip netns exec`
//! inside the sandbox's namespace (the host's iperf3, only its network namespace is
//! the sandbox's), its policy allowing that address, and the same inside the raw
//! namespace (a veth to the edge's namespace, masqueraded there onto the uplink, no
//! OpenDsec table in its way). The figure is what the receiver got (iperf3's
//! `sum_received`); each round runs the four tests in a rotated order and the report
//! takes the median round's per test.

use std::process::{Command, Stdio};

use serde_json::Value;

use super::internet::{IPERF, IPERF_PORT};

/// Which end of the path, and which way the data goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Test {
    SandboxUp,
    SandboxDown,
    RawUp,
    RawDown,
}

impl Test {
    pub(super) const ALL: [Test; 4] = [Test::SandboxUp, Test::RawUp, Test::SandboxDown, Test::RawDown];

    fn reverse(self) -> bool {
        matches!(self, Test::SandboxDown | Test::RawDown)
    }
}

/// Bits per second each test got, one entry per round.
#[derive(Default)]
pub(super) struct Throughput {
    pub(super) seconds: u32,
    pub(super) sandbox_up: Vec<f64>,
    pub(super) sandbox_down: Vec<f64>,
    pub(super) raw_up: Vec<f64>,
    pub(super) raw_down: Vec<f64>,
    pub(super) errors: Vec<String>,
}

impl Throughput {
    fn of(&mut self, t: Test) -> &mut Vec<f64> {
        match t {
            Test::SandboxUp => &mut self.sandbox_up,
            Test::SandboxDown => &mut self.sandbox_down,
            Test::RawUp => &mut self.raw_up,
            Test::RawDown => &mut self.raw_down,
        }
    }
}

/// `rounds` rounds of the four tests, `seconds` each.
pub(super) async fn measure(sandbox_ns: &str, raw_ns: &str, rounds: usize, seconds: u32) -> Throughput {
    let mut r = Throughput {
        seconds,
        ..Throughput::default()
    };
    for round in 0..rounds {
        for k in 0..Test::ALL.len() {
            let t = Test::ALL[(k + round) % Test::ALL.len()];
            let ns = match t {
                Test::SandboxUp | Test::SandboxDown => sandbox_ns.to_string(),
                Test::RawUp | Test::RawDown => raw_ns.to_string(),
            };
            let got = tokio::task::spawn_blocking(move || iperf3(&ns, t.reverse(), seconds))
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r);
            match got {
                Ok(bps) => {
                    eprintln!("   round {}/{rounds} {t:?}: {:.2} Gbit/s", round + 1, bps / 1e9);
                    r.of(t).push(bps);
                }
                Err(e) => r.errors.push(format!("{t:?}, round {}: {e}", round + 1)),
            }
        }
    }
    r
}

/// One `iperf3 -c` inside namespace `ns`: the receiver's bits per second.
fn iperf3(ns: &str, reverse: bool, seconds: u32) -> Result<f64, String> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns, "iperf3", "-c", &IPERF.to_string()])
        .args(["-p", &IPERF_PORT.to_string(), "-t", &seconds.to_string(), "-J"])
        .args(["--connect-timeout", "3000"])
        .stdin(Stdio::null());
    if reverse {
        cmd.arg("-R");
    }
    let out = cmd.output().map_err(|e| format!("run iperf3: {e}"))?;
    let v: Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "iperf3 printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })?;
    if let Some(e) = v["error"].as_str() {
        return Err(format!("iperf3: {e}"));
    }
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .ok_or_else(|| "iperf3's JSON has no end.sum_received.bits_per_second".to_string())
}
