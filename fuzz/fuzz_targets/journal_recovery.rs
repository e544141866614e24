//! Journal recovery after a crash: arbitrary bytes as the contents of `log.journal`,
//! read back as `Store::open` does (the live generation's records while each checks out
//! and the indexes run on, each record decoded as a Raft entry and checked to hold its
//! index). Bad bytes end the scan or fail the open; they never panic.
//!
//! Input: a mode byte, then the file. An odd mode first rewrites each record's
//! generation and checksum so that it checks out (`opendsec_fuzz::seal_journal`): the
//! fuzzer cannot forge a CRC-32 itself, and the entries' decoding is behind it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use opendsec_fuzz::{LIVE_GENERATION, seal_journal};
use opendsec_log::fuzzing;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, file)) = data.split_first() else {
        return;
    };
    if mode & 1 == 1 {
        let mut sealed = file.to_vec();
        seal_journal(&mut sealed);
        let _ = fuzzing::recover_journal(&sealed, LIVE_GENERATION);
    } else {
        let _ = fuzzing::recover_journal(file, LIVE_GENERATION);
    }
});
