//! The store's tests: durability through the journal and redb, inline appends, the
//! tail's reads and eviction, truncation and purge.

use openraft::RaftLogReader;
use openraft::storage::{IOFlushed, RaftLogStorage};

use super::writer::Busy;
use super::*;
use crate::TypeConfig;
use crate::typ::{LogId, Vote};
use tests_support::*;

mod tests_support {
    use openraft::entry::RaftEntry;
    use openraft::type_config::TypeConfigExt;

    use super::*;
    use crate::Payload;

    pub type Lid = openraft::impls::leader_id_adv::LeaderId<u64, u64>;

    pub fn log_id(term: u64, index: u64) -> LogId {
        LogId::new(Lid { term, node_id: 1 }, index)
    }

    pub fn entry(term: u64, index: u64, len: usize) -> Entry {
        Entry::new_normal(log_id(term, index), Payload(vec![(index % 251) as u8; len]))
    }

    pub fn indexes(v: &[Entry]) -> Vec<(u64, u64)> {
        v.iter()
            .map(|e| (e.log_id.committed_leader_id().term, e.log_id.index()))
            .collect()
    }

    pub async fn append(
        store: &mut Store,
        entries: Vec<Entry>,
    ) -> openraft::type_config::alias::OneshotReceiverOf<TypeConfig, Result<(), io::Error>> {
        let (tx, rx) = TypeConfig::oneshot();
        store.append(entries, IOFlushed::signal(tx)).await.expect("append");
        rx
    }
}

#[tokio::test]
async fn appends_are_readable_at_once_and_durable_once_flushed() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), None).unwrap();
    let rx = append(&mut store, (1..=50).map(|i| entry(1, i, 100)).collect()).await;
    // Readable before the flush is reported (the tail).
    let got = store.try_get_log_entries(1..=50).await.unwrap();
    assert_eq!(got.len(), 50);
    rx.await.unwrap().expect("flushed");
    store.save_committed(Some(log_id(1, 40))).await.unwrap();
    store.save_vote(&Vote::new_committed(1, 1)).await.unwrap();
    store.close();
    drop(store);

    let mut store = Store::open(dir.path(), None).unwrap();
    let got = store.try_get_log_entries(..).await.unwrap();
    assert_eq!(indexes(&got), (1..=50).map(|i| (1, i)).collect::<Vec<_>>());
    assert_eq!(got[9].payload, entry(1, 10, 100).payload);
    assert_eq!(store.read_committed().await.unwrap(), Some(log_id(1, 40)));
    assert_eq!(store.read_vote().await.unwrap(), Some(Vote::new_committed(1, 1)));
    assert_eq!(store.get_log_state().await.unwrap().last_log_id, Some(log_id(1, 50)));
    store.close();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_appends_are_flushed_when_append_returns_and_keep_order_with_queued_operations() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), None).unwrap();
    // Off by default: the writer thread commits.
    let rx = append(&mut store, vec![entry(1, 1, 100)]).await;
    rx.await.unwrap().expect("flushed");
    assert_eq!(store.io_stats().inline_appends, 0);

    store.save_committed(Some(log_id(1, 1))).await.unwrap();
    // Let the writer finish on its own first (idle: it retires the journal with the
    // committed id), so that it is not busy when the inline appends below come.
    let quiet = Instant::now() + Duration::from_secs(10);
    while store.io_stats().durable_commits == 0 && Instant::now() < quiet {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        store.io_stats().durable_commits,
        1,
        "the idle writer retired the journal"
    );
    store.set_inline(Inline::Lone);
    for i in 2..=20 {
        let mut rx = append(&mut store, vec![entry(1, i, 100)]).await;
        // Committed by `append` itself: flushed already when it returns.
        assert!(matches!(rx.try_recv(), Ok(Ok(()))), "append {i} was not flushed inline");
        // What the core does with the flush (a lone node commits it at once).
        store.save_committed(Some(log_id(1, i))).await.unwrap();
    }
    assert_eq!(store.io_stats().inline_appends, 19);
    // A flush the core has not handled yet (not committed): the next append is the
    // writer's, so that flush's commit does not wait for another fsync.
    let rx = append(&mut store, vec![entry(1, 21, 100)]).await;
    rx.await.unwrap().expect("flushed");
    let rx = append(&mut store, vec![entry(1, 22, 100)]).await;
    rx.await.unwrap().expect("flushed");
    assert_eq!(
        store.io_stats().inline_appends,
        20,
        "only the first of the two was inline"
    );
    store.save_committed(Some(log_id(1, 22))).await.unwrap();
    // A batch of several entries (concurrent writes) goes to the writer.
    let rx = append(&mut store, vec![entry(1, 23, 100), entry(1, 24, 100)]).await;
    rx.await.unwrap().expect("flushed");
    assert_eq!(store.io_stats().inline_appends, 20);

    // While a batch is being written (held here as an inline batch would be), an append
    // is queued, and the writer commits it only once that batch is done.
    let flow = store.inner.flow.clone();
    let held = Busy::wait(&flow, 0);
    let mut rx = append(&mut store, vec![entry(1, 25, 100)]).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        rx.try_recv().is_err(),
        "the writer committed while another batch was being written"
    );
    drop(held);
    rx.await.unwrap().expect("flushed");
    assert_eq!(store.io_stats().inline_appends, 20);
    store.save_vote(&Vote::new_committed(2, 1)).await.unwrap();
    store.close();
    drop(store);
    let mut store = Store::open(dir.path(), None).unwrap();
    let got = store.try_get_log_entries(..).await.unwrap();
    assert_eq!(
        indexes(&got),
        (1..=25).map(|i| (1, i)).collect::<Vec<_>>(),
        "every append is durable"
    );
    assert_eq!(store.read_vote().await.unwrap(), Some(Vote::new_committed(2, 1)));
    store.close();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followers_appends_commit_inline_only_when_they_come_far_apart() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), None).unwrap();
    store.set_inline(Inline::Follower);
    // Far apart (100 ms, many fsyncs): each commits on the caller's thread.
    for i in 1..=5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut rx = append(&mut store, vec![entry(1, i, 100)]).await;
        assert!(matches!(rx.try_recv(), Ok(Ok(()))), "append {i} was not flushed inline");
    }
    assert_eq!(store.io_stats().inline_appends, 5);
    // A follower's committed id goes to the writer, as without inline appends.
    store.save_committed(Some(log_id(1, 5))).await.unwrap();
    // Right after an inline one ended (as those queued behind it in the core come): to
    // the writer.
    let just_ended = || store.inner.opened.elapsed().as_micros() as u64;
    store.inner.inline_end_us.store(just_ended(), Ordering::Relaxed);
    let rx = append(&mut store, vec![entry(1, 6, 100)]).await;
    rx.await.unwrap().expect("flushed");
    assert_eq!(
        store.io_stats().inline_appends,
        5,
        "an append queued behind an inline one went inline too"
    );
    // A burst: whatever finds the writer busy queues, and the writer shares its fsyncs.
    let mut pending = Vec::new();
    for i in 7..=45 {
        pending.push(append(&mut store, vec![entry(1, i, 100)]).await);
    }
    for rx in pending {
        rx.await.unwrap().expect("flushed");
    }
    let s = store.io_stats();
    assert!(s.durable_commits < 5 + 40, "the writer shared no fsync: {s:?}");
    store.close();
    drop(store);
    let mut store = Store::open(dir.path(), None).unwrap();
    let got = store.try_get_log_entries(..).await.unwrap();
    assert_eq!(
        indexes(&got),
        (1..=45).map(|i| (1, i)).collect::<Vec<_>>(),
        "every append is durable"
    );
    assert_eq!(store.read_committed().await.unwrap(), Some(log_id(1, 5)));
    store.close();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn with_one_worker_thread_only_sparse_appends_commit_inline() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), None).unwrap();
    store.set_inline(Inline::Follower);
    // One write at a time, far apart: inline, as with more workers.
    for i in 1..=3 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut rx = append(&mut store, vec![entry(1, i, 100)]).await;
        assert!(matches!(rx.try_recv(), Ok(Ok(()))), "append {i} was not flushed inline");
    }
    // Appends close together (a busy node): an inline fsync would stall the only
    // worker, so each goes to the writer, even when it finds the writer idle.
    for i in 4..=10 {
        store
            .inner
            .last_single_us
            .store(store.inner.opened.elapsed().as_micros() as u64, Ordering::Relaxed);
        let rx = append(&mut store, vec![entry(1, i, 100)]).await;
        rx.await.unwrap().expect("flushed");
    }
    assert_eq!(
        store.io_stats().inline_appends,
        3,
        "a busy one-worker node committed inline"
    );
    let got = store.try_get_log_entries(..).await.unwrap();
    assert_eq!(indexes(&got), (1..=10).map(|i| (1, i)).collect::<Vec<_>>());
    store.close();
}

#[tokio::test]
async fn inline_appends_need_a_multi_thread_runtime_and_fall_back_to_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), None).unwrap();
    store.set_inline(Inline::Lone);
    let rx = append(&mut store, vec![entry(1, 1, 100)]).await;
    rx.await.unwrap().expect("flushed");
    assert_eq!(
        store.io_stats().inline_appends,
        0,
        "a current-thread runtime cannot lend its thread"
    );
    store.close();
}

#[tokio::test]
async fn a_leaders_append_reaches_the_writer_once_the_appending_task_yields() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), None).unwrap();
    let written = |s: &Store| {
        let st = s.io_stats();
        st.durable_commits + st.journal_syncs
    };
    // Inline appends off (a leader): held while this task runs on without yielding.
    let rx = append(&mut store, vec![entry(1, 1, 100)]).await;
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(written(&store), 0, "the writer was woken before the task yielded");
    // Readable meanwhile: replication reads it from the tail.
    assert_eq!(store.try_get_log_entries(1..=1).await.unwrap().len(), 1);
    // An operation that is not held releases it first: the order holds.
    store.save_vote(&Vote::new_committed(1, 1)).await.unwrap();
    rx.await.unwrap().expect("flushed");
    // Yielding (here: awaiting the flush) releases it.
    let rx = append(&mut store, vec![entry(1, 2, 100)]).await;
    rx.await.unwrap().expect("flushed");
    store.close();
    let mut store = Store::open(dir.path(), None).unwrap();
    assert_eq!(
        indexes(&store.try_get_log_entries(..).await.unwrap()),
        vec![(1, 1), (1, 2)]
    );
    assert_eq!(store.read_vote().await.unwrap(), Some(Vote::new_committed(1, 1)));
    store.close();
}

/// What a crash of the process leaves: the files as they are now, in a new directory.
fn crash_copy(from: &Path) -> tempfile::TempDir {
    let to = tempfile::tempdir().unwrap();
    for f in ["log.redb", journal::FILE] {
        std::fs::copy(from.join(f), to.path().join(f)).unwrap();
    }
    to
}

async fn flushed(store: &mut Store, entries: Vec<Entry>) {
    append(store, entries).await.await.unwrap().expect("flushed");
}

#[tokio::test]
async fn appends_are_durable_in_the_journal_before_redb_holds_them_durably() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), None).unwrap();
    flushed(&mut store, (1..=10).map(|i| entry(1, i, 100)).collect()).await;
    flushed(&mut store, vec![entry(1, 11, 100)]).await;
    flushed(&mut store, (12..=30).map(|i| entry(1, i, 100)).collect()).await;
    let crashed = crash_copy(dir.path());
    let s = store.io_stats();
    assert_eq!(
        (s.durable_commits, s.journal_syncs),
        (0, 3),
        "three journal writes and no redb commit"
    );

    let mut again = Store::open(crashed.path(), None).unwrap();
    let got = again.try_get_log_entries(..).await.unwrap();
    assert_eq!(
        indexes(&got),
        (1..=30).map(|i| (1, i)).collect::<Vec<_>>(),
        "every flushed append survives"
    );
    assert_eq!(got[20].payload, entry(1, 21, 100).payload);
    assert_eq!(again.get_log_state().await.unwrap().last_log_id, Some(log_id(1, 30)));
    // Recovery retired that journal: a second crash right away finds the same log.
    let twice = crash_copy(crashed.path());
    let mut third = Store::open(twice.path(), None).unwrap();
    assert_eq!(third.try_get_log_entries(..).await.unwrap().len(), 30);
    for s in [store, again, third] {
        s.close();
    }
}

#[tokio::test]
async fn a_truncation_commits_durably_and_retires_the_journal_so_truncated_entries_never_come_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), None).unwrap();
    flushed(&mut store, (1..=10).map(|i| entry(1, i, 100)).collect()).await;
    store.truncate_after(Some(log_id(1, 5))).await.unwrap();
    assert_eq!(store.io_stats().durable_commits, 1);
    flushed(&mut store, vec![entry(2, 6, 100), entry(2, 7, 100)]).await;
    let crashed = crash_copy(dir.path());
    assert_eq!(
        store.io_stats().durable_commits,
        1,
        "the new entries are in the journal only"
    );

    let mut again = Store::open(crashed.path(), None).unwrap();
    let want: Vec<_> = (1..=5).map(|i| (1, i)).chain([(2, 6), (2, 7)]).collect();
    assert_eq!(indexes(&again.try_get_log_entries(..).await.unwrap()), want);
    store.close();
    again.close();
}

#[tokio::test]
async fn a_torn_journal_write_loses_only_itself_and_the_journal_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), None).unwrap();
    let mut end = 0;
    for i in 1..=3 {
        flushed(&mut store, vec![entry(1, i, 100)]).await;
        end += journal::HEADER + encode(&entry(1, i, 100)).unwrap().len();
    }
    let crashed = crash_copy(dir.path());
    store.close();
    // The third record's last byte never reached the disk.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(crashed.path().join(journal::FILE))
            .unwrap();
        f.write_all_at(&[0xff], (end - 1) as u64).unwrap();
    }
    let mut again = Store::open(crashed.path(), None).unwrap();
    assert_eq!(
        indexes(&again.try_get_log_entries(..).await.unwrap()),
        vec![(1, 1), (1, 2)]
    );
    flushed(&mut again, vec![entry(2, 3, 50)]).await;
    flushed(&mut again, vec![entry(2, 4, 50)]).await;
    let twice = crash_copy(crashed.path());
    let mut third = Store::open(twice.path(), None).unwrap();
    assert_eq!(
        indexes(&third.try_get_log_entries(..).await.unwrap()),
        vec![(1, 1), (1, 2), (2, 3), (2, 4)]
    );
    again.close();
    third.close();
}

#[tokio::test]
async fn a_batch_that_does_not_fit_the_journal_commits_durably_and_retires_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open_with(dir.path(), None, TAIL_BYTES, 2048).unwrap();
    for i in 1..=20 {
        flushed(&mut store, vec![entry(1, i, 200)]).await;
    }
    let s = store.io_stats();
    assert!(s.durable_commits >= 2 && s.journal_syncs >= 10, "{s:?}");
    assert_eq!(s.durable_commits + s.journal_syncs, 20);
    let crashed = crash_copy(dir.path());
    let mut again = Store::open_with(crashed.path(), None, TAIL_BYTES, 2048).unwrap();
    assert_eq!(
        indexes(&again.try_get_log_entries(..).await.unwrap()),
        (1..=20).map(|i| (1, i)).collect::<Vec<_>>()
    );
    store.close();
    again.close();
}

#[derive(Clone, Debug)]
enum Step {
    /// Append this many entries (one batch) and wait until flushed.
    Append(u64),
    /// Truncate after the entry this far from the end (1: drop the last).
    Truncate(u64),
    Vote,
    /// Purge (archive) the first this many live entries.
    Purge(u64),
    /// Copy the files as they are, open the copy and go on there.
    Crash,
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (1u64..6).prop_map(Step::Append),
        1 => (1u64..4).prop_map(Step::Truncate),
        1 => Just(Step::Vote),
        1 => (1u64..8).prop_map(Step::Purge),
        2 => Just(Step::Crash),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 24, ..Default::default() })]
    /// Whatever mix of appends, truncations, votes and purges (with a small journal,
    /// so that batches also go to durable commits, and a small tail, so that reads go
    /// to redb), the log reads back as written after every step, and a crash at any
    /// point keeps exactly the flushed log: nothing acknowledged is lost and nothing
    /// truncated comes back.
    #[test]
    fn a_crash_at_any_point_keeps_exactly_the_flushed_log(steps in proptest::collection::vec(step(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            const CAP: u64 = 1500;
            const TAIL: usize = 600;
            let mut dir = tempfile::tempdir().unwrap();
            let mut store = Store::open_with(dir.path(), None, TAIL, CAP).unwrap();
            // The live log (after the purged part) and the last purged id.
            let mut live: Vec<(u64, u64)> = Vec::new();
            let mut purged: Option<LogId> = None;
            let mut term = 1;
            let mut voted = None;
            for s in steps {
                match s {
                    Step::Append(n) => {
                        let next = live.last().map(|(_, i)| i + 1).or(purged.map(|p| p.index() + 1)).unwrap_or(1);
                        let batch: Vec<Entry> = (next..next + n).map(|i| entry(term, i, 90)).collect();
                        live.extend(batch.iter().map(|e| (term, e.log_id.index())));
                        flushed(&mut store, batch).await;
                    }
                    Step::Truncate(k) => {
                        let keep = live.len().saturating_sub(k as usize);
                        live.truncate(keep);
                        let after = live.last().map(|(t, i)| log_id(*t, *i)).or(purged);
                        store.truncate_after(after).await.unwrap();
                        // A new leader's entries follow a truncation.
                        term += 1;
                    }
                    Step::Vote => {
                        let v = Vote::new_committed(term, 1);
                        store.save_vote(&v).await.unwrap();
                        voted = Some(v);
                    }
                    Step::Purge(k) => {
                        let k = (k as usize).min(live.len());
                        if k > 0 {
                            let (t, i) = live[k - 1];
                            live.drain(..k);
                            purged = Some(log_id(t, i));
                            store.purge_soon(log_id(t, i)).await.unwrap().unwrap();
                        }
                    }
                    Step::Crash => {
                        let copy = crash_copy(dir.path());
                        store.close();
                        dir = copy;
                        store = Store::open_with(dir.path(), None, TAIL, CAP).unwrap();
                        assert_eq!(store.read_vote().await.unwrap(), voted);
                        assert_eq!(store.get_log_state().await.unwrap().last_purged_log_id, purged);
                    }
                }
                let got = store.try_get_log_entries(..).await.unwrap();
                assert_eq!(indexes(&got), live, "the log after {s:?}");
            }
            store.close();
        });
    }
}

#[tokio::test]
async fn an_idle_writer_retires_the_journal() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), None).unwrap();
    flushed(&mut store, (1..=5).map(|i| entry(1, i, 100)).collect()).await;
    assert_eq!(store.io_stats().durable_commits, 0);
    tokio::time::sleep(COMMITTED_EVERY * 4).await;
    assert_eq!(store.io_stats().durable_commits, 1, "one durable commit once idle");
    assert!(lock(&store.inner.journal).is_empty());
    store.close();
}

#[tokio::test]
async fn reads_span_redb_and_the_tail_after_eviction() {
    let dir = tempfile::tempdir().unwrap();
    // A budget of ~10 entries: most written entries leave the tail. A journal of ~30:
    // every other batch goes to redb with the one before it.
    let mut store = Store::open_with(dir.path(), None, 10 * 1100, 30 * 1100).unwrap();
    for chunk in 0..10u64 {
        let rx = append(&mut store, (1..=20).map(|i| entry(1, chunk * 20 + i, 1000)).collect()).await;
        rx.await.unwrap().expect("flushed");
    }
    {
        let tail = store.tail();
        assert!(tail.entries.len() < 30, "tail kept {} entries", tail.entries.len());
        assert_eq!(tail.last_index(), Some(200));
    }
    for (a, b) in [(1, 200), (150, 200), (185, 195), (1, 5), (199, 250)] {
        let got = store.try_get_log_entries(a..=b).await.unwrap();
        assert_eq!(
            indexes(&got),
            (a..=b.min(200)).map(|i| (1, i)).collect::<Vec<_>>(),
            "range {a}..={b}"
        );
    }
    assert_eq!(store.try_get_log_entries(180..).await.unwrap().len(), 21);
    let payloads = store.read_entries(190, 200).unwrap();
    assert_eq!(
        payloads.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        (190..=200).collect::<Vec<_>>()
    );
    store.close();
}

#[tokio::test]
async fn truncation_hides_entries_at_once_and_new_ones_replace_them() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), None).unwrap();
    let rx = append(&mut store, (1..=10).map(|i| entry(1, i, 10)).collect()).await;
    rx.await.unwrap().unwrap();
    // Not yet flushed appends, then a truncation in the middle of them.
    drop(append(&mut store, (11..=15).map(|i| entry(1, i, 10)).collect()).await);
    store.truncate_after(Some(log_id(1, 7))).await.unwrap();
    assert_eq!(
        indexes(&store.try_get_log_entries(1..=20).await.unwrap()),
        (1..=7).map(|i| (1, i)).collect::<Vec<_>>()
    );
    let rx = append(&mut store, (8..=9).map(|i| entry(2, i, 10)).collect()).await;
    rx.await.unwrap().unwrap();
    let want: Vec<_> = (1..=7).map(|i| (1, i)).chain([(2, 8), (2, 9)]).collect();
    assert_eq!(indexes(&store.try_get_log_entries(..).await.unwrap()), want);
    store.close();
    drop(store);
    let mut store = Store::open(dir.path(), None).unwrap();
    assert_eq!(indexes(&store.try_get_log_entries(..).await.unwrap()), want);
    assert_eq!(store.get_log_state().await.unwrap().last_log_id, Some(log_id(2, 9)));
    store.close();
}

#[tokio::test]
async fn purge_archives_in_order_with_pending_appends() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), None).unwrap();
    drop(append(&mut store, (1..=30).map(|i| entry(1, i, 10)).collect()).await);
    // Queued behind the (maybe unwritten) appends: it still finds them.
    store.purge_soon(log_id(1, 20)).await.unwrap().unwrap();
    assert_eq!(store.archived_count().unwrap(), 20);
    assert_eq!(store.live_count().unwrap(), 10);
    assert_eq!(store.tail().entries.front().map(|(e, _)| e.log_id.index()), Some(21));
    let all = store.read_entries(1, 30).unwrap();
    assert_eq!(
        all.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        (1..=30).collect::<Vec<_>>()
    );
    let st = store.get_log_state().await.unwrap();
    assert_eq!(
        (st.last_purged_log_id, st.last_log_id),
        (Some(log_id(1, 20)), Some(log_id(1, 30)))
    );
    store.close();
}

#[tokio::test]
async fn appends_are_flushed_between_the_chunks_of_a_purge() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), None).unwrap();
    let n = 5 * PURGE_CHUNK as u64;
    flushed(&mut store, (1..=n).map(|i| entry(1, i, 50)).collect()).await;
    let s2 = store.clone();
    let upto = n - 100;
    let purge = tokio::spawn(async move { s2.purge_soon(log_id(1, upto)).await.unwrap() });
    let mut i = n + 1;
    let mut flushed_during = 0;
    while !purge.is_finished() {
        let rx = append(&mut store, vec![entry(1, i, 50)]).await;
        rx.await.unwrap().unwrap();
        flushed_during += u64::from(!purge.is_finished());
        i += 1;
    }
    purge.await.unwrap().unwrap();
    assert!(flushed_during >= 1, "no append was flushed while the purge ran");
    let st = store.get_log_state().await.unwrap();
    assert_eq!(st.last_purged_log_id, Some(log_id(1, upto)));
    assert_eq!(store.archived_count().unwrap(), upto);
    let all = store.read_entries(1, i - 1).unwrap();
    assert_eq!(
        all.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
        (1..i).collect::<Vec<_>>()
    );
    store.close();
    drop(store);
    let mut store = Store::open(dir.path(), None).unwrap();
    assert_eq!(
        store.get_log_state().await.unwrap().last_purged_log_id,
        Some(log_id(1, upto))
    );
    assert_eq!(store.try_get_log_entries(..).await.unwrap().len() as u64, i - 1 - upto);
    store.close();
}

#[test]
fn tail_stays_contiguous() {
    let mut t = Tail::default();
    for i in 5..=9 {
        t.push(entry(1, i, 10), 10);
    }
    t.mark_written(&log_id(1, 8));
    assert_eq!(t.written, Some(8));
    // Overwrite from 7: what was written from there on no longer is.
    t.push(entry(2, 7, 10), 10);
    assert_eq!((t.first, t.last_index(), t.written), (5, Some(7), Some(6)));
    // A gap (snapshot install): start afresh.
    t.push(entry(3, 20, 10), 10);
    assert_eq!((t.first, t.last_index(), t.bytes), (20, Some(20), 10));
    // A stale mark (another log id at that index) changes nothing.
    t.mark_written(&log_id(1, 20));
    assert_eq!(t.written, Some(6));
    t.mark_written(&log_id(3, 20));
    assert_eq!(t.written, Some(20));
    t.evict(0);
    assert!(t.entries.is_empty());
    assert_eq!(t.first, 21);
    assert_eq!(t.range(1, None), (None, Vec::new()));
}

#[tokio::test]
async fn a_snapshot_kept_in_redb_by_an_earlier_version_is_read_then_replaced_by_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), None).unwrap();
    let old = SnapshotMeta {
        last_log_id: Some(log_id(1, 10)),
        last_membership: Default::default(),
    };
    // Where versions before the snapshot file wrote it.
    store
        .write(Durability::Immediate, |txn| {
            let mut t = txn.open_table(SNAPSHOT)?;
            t.insert(K_SNAP_META, encode(&old).unwrap().as_slice())?;
            t.insert(K_SNAP_DATA, b"old state".as_slice())?;
            Ok(())
        })
        .unwrap();
    assert_eq!(
        store.load_snapshot().unwrap(),
        Some((old.clone(), b"old state".to_vec()))
    );
    assert_eq!(store.snapshot_meta().unwrap(), Some(old));

    let new = SnapshotMeta {
        last_log_id: Some(log_id(2, 20)),
        last_membership: Default::default(),
    };
    store.save_snapshot(&new, b"new state".to_vec()).await.unwrap();
    assert!(dir.path().join(snapshot_file::FILE).exists());
    let rows = store
        .with_db(|db| Ok(db.begin_read()?.open_table(SNAPSHOT)?.len()?))
        .unwrap();
    assert_eq!(rows, 0, "the redb copy is dropped once the file holds a newer snapshot");
    store.close();
    drop(store);

    let store = Store::open(dir.path(), None).unwrap();
    assert_eq!(
        store.load_snapshot().unwrap(),
        Some((new.clone(), b"new state".to_vec()))
    );
    assert_eq!(store.snapshot_meta().unwrap(), Some(new));
}

#[tokio::test]
async fn a_purge_is_answered_once_queued_and_the_log_state_counts_it_purged_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(dir.path(), None).unwrap();
    let n = 20 * PURGE_CHUNK as u64;
    flushed(&mut store, (1..=n).map(|i| entry(1, i, 50)).collect()).await;
    // openraft's core waits for this call: it must not wait for the archive.
    store.purge(log_id(1, n - 10)).await.unwrap();
    let st = store.get_log_state().await.unwrap();
    assert_eq!(st.last_purged_log_id, Some(log_id(1, n - 10)));
    assert_eq!(st.last_log_id, Some(log_id(1, n)));
    // The live entries stay readable whatever the writer has moved so far.
    let live = store.try_get_log_entries(n - 9..=n).await.unwrap();
    assert_eq!(live.len(), 10);
    // And the writer finishes it.
    store.purge_soon(log_id(1, n - 10)).await.unwrap().unwrap();
    assert_eq!(store.archived_count().unwrap(), n - 10);
    assert_eq!(store.live_count().unwrap(), 10);
    store.close();
}
