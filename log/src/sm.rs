//! openraft state-machine wrapper around the application's [`StateMachine`].
//!
//! The application state lives only in memory. Snapshots (application bytes + last applied
//! log id + membership) are stored durably in redb by [`Store::save_snapshot`]; on restart
//! openraft installs the stored snapshot and re-applies the committed entries after it.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};
use std::time::{Duration, Instant};

use futures::{Stream, TryStreamExt};
use openraft::storage::{EntryResponder, RaftStateMachine};
use openraft::{EntryPayload, OptionalSend, RaftSnapshotBuilder};
use tokio::sync::{broadcast, watch};

use crate::node::AppliedEntry;
use crate::store::Store;
use crate::typ::{LogId, Snapshot, SnapshotMeta, StoredMembership};
use crate::{StateMachine, TypeConfig};

pub(crate) struct SmState<S> {
    pub(crate) app: S,
    pub(crate) last_applied: Option<LogId>,
    pub(crate) membership: StoredMembership,
}

pub(crate) struct Shared<S> {
    pub(crate) state: RwLock<SmState<S>>,
    /// Index of the last applied entry (any kind), `None` before the first one.
    pub(crate) applied_tx: watch::Sender<Option<u64>>,
    pub(crate) events: broadcast::Sender<AppliedEntry>,
    pub(crate) store: Store,
    /// A snapshot is being serialised (holding the state's read lock, on a thread of its own).
    snapshotting: AtomicBool,
}

impl<S> Shared<S> {
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, SmState<S>> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, SmState<S>> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The write lock for the apply path. While a snapshot is serialised (hundreds of ms
    /// for a large state) this waits asynchronously: blocked on the lock, the node's
    /// executor thread could not answer heartbeats or replicate, and it would lose its
    /// lease or its leader. Otherwise readers hold the lock only briefly: it blocks.
    async fn write_for_apply(&self) -> RwLockWriteGuard<'_, SmState<S>> {
        loop {
            if !self.snapshotting.load(Ordering::Acquire) {
                return self.write();
            }
            match self.state.try_write() {
                Ok(g) => return g,
                Err(TryLockError::Poisoned(e)) => return e.into_inner(),
                Err(TryLockError::WouldBlock) => {}
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// Clears the snapshotting flag however the serialisation ends.
struct Snapshotting<'a>(&'a AtomicBool);

impl Drop for Snapshotting<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// The openraft `RaftStateMachine` implementation (cheap to clone).
pub struct SmStore<S> {
    pub(crate) shared: Arc<Shared<S>>,
}

impl<S> Clone for SmStore<S> {
    fn clone(&self) -> Self {
        SmStore {
            shared: self.shared.clone(),
        }
    }
}

impl<S: StateMachine> SmStore<S> {
    pub(crate) fn new(app: S, store: Store, subscribe_capacity: usize) -> Self {
        let (applied_tx, _) = watch::channel(None);
        let (events, _) = broadcast::channel(subscribe_capacity.max(1));
        SmStore {
            shared: Arc::new(Shared {
                state: RwLock::new(SmState {
                    app,
                    last_applied: None,
                    membership: StoredMembership::default(),
                }),
                applied_tx,
                events,
                store,
                snapshotting: AtomicBool::new(false),
            }),
        }
    }
}

impl<S: StateMachine> RaftSnapshotBuilder<TypeConfig> for SmStore<S> {
    type SnapshotData = Vec<u8>;

    async fn build_snapshot(&mut self) -> Result<Snapshot, io::Error> {
        // Serialised and written on a thread of its own: the whole state is tens of MB at
        // the default interval, hundreds of ms that this node's executor (one thread per
        // node in a cluster sharing a host) must spend answering its peers instead.
        let shared = self.shared.clone();
        let built = in_background("opendsec-snapshot", move || -> io::Result<_> {
            let started = Instant::now();
            let (data, meta) = {
                shared.snapshotting.store(true, Ordering::Release);
                let _flag = Snapshotting(&shared.snapshotting);
                let st = shared.read();
                let meta = SnapshotMeta {
                    last_log_id: st.last_applied,
                    last_membership: st.membership.clone(),
                };
                (st.app.snapshot(), meta)
            };
            let serialised = started.elapsed();
            shared.store.save_snapshot_now(&meta, &data)?;
            tracing::info!(last_log_id = ?meta.last_log_id, bytes = data.len(), ?serialised, total = ?started.elapsed(), "snapshot built");
            Ok(Snapshot { meta, snapshot: data })
        });
        built.await
    }
}

/// Runs `f` on a thread of its own at a lower CPU priority (nice 10, this thread only):
/// a snapshot can wait, while this host's heartbeats and appends cannot. Every node of a
/// cluster builds one at the same index; at normal priority they took the cores from the
/// nodes' executors for long enough that followers called an election.
async fn in_background<R: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> io::Result<R> + Send + 'static,
) -> io::Result<R> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new().name(name.into()).spawn(move || {
        // SAFETY: setpriority only reads its arguments; on Linux, PRIO_PROCESS with 0 is
        // the calling thread. A failure leaves the thread at normal priority.
        unsafe {
            libc::setpriority(libc::PRIO_PROCESS, 0, 10);
        }
        let _ = tx.send(f());
    })?;
    rx.await
        .map_err(|_| io::Error::other("the snapshot thread ended without an answer"))?
}

impl<S: StateMachine> RaftStateMachine<TypeConfig> for SmStore<S> {
    type SnapshotData = Vec<u8>;
    type SnapshotBuilder = Self;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), io::Error> {
        let st = self.shared.read();
        Ok((st.last_applied, st.membership.clone()))
    }

    async fn apply<Strm>(&mut self, entries: Strm) -> Result<(), io::Error>
    where
        Strm: Stream<Item = Result<EntryResponder<TypeConfig>, io::Error>> + Unpin + OptionalSend,
    {
        let batch: Vec<EntryResponder<TypeConfig>> = entries.try_collect().await?;
        let mut done = Vec::with_capacity(batch.len());
        {
            let mut st = self.shared.write_for_apply().await;
            for (entry, responder) in batch {
                let index = entry.log_id.index();
                st.last_applied = Some(entry.log_id);
                let (response, event) = match entry.payload {
                    EntryPayload::Normal(p) => {
                        let r = st.app.apply(index, &p.0);
                        let ev = AppliedEntry {
                            index,
                            payload: Arc::from(p.0),
                        };
                        (r, Some(ev))
                    }
                    EntryPayload::Membership(m) => {
                        st.membership = StoredMembership::new(Some(entry.log_id), m);
                        (Vec::new(), None)
                    }
                    EntryPayload::Blank => (Vec::new(), None),
                };
                done.push((index, response, responder, event));
            }
        }
        // The applied index is published before anyone hears of the entries: a proposer
        // that reads right after its write returns (`read_entries`, which stops at the
        // applied index) finds it.
        if let Some((index, ..)) = done.last() {
            self.shared.applied_tx.send_replace(Some(*index));
        }
        for (_, response, responder, event) in done {
            if let Some(r) = responder {
                r.send(response);
            }
            if let Some(ev) = event {
                // No subscriber is not an error.
                let _ = self.shared.events.send(ev);
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn install_snapshot(&mut self, meta: &SnapshotMeta, snapshot: Vec<u8>) -> Result<(), io::Error> {
        {
            let mut st = self.shared.write();
            st.app
                .restore(&snapshot)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("restore snapshot: {e}")))?;
            st.last_applied = meta.last_log_id;
            st.membership = meta.last_membership.clone();
        }
        // On restart openraft re-installs the stored snapshot: no need to write it again.
        let stored = self.shared.store.snapshot_meta()?;
        if stored.as_ref() != Some(meta) {
            self.shared.store.save_snapshot(meta, snapshot).await?;
        }
        tracing::info!(last_log_id = ?meta.last_log_id, "snapshot installed");
        self.shared.applied_tx.send_replace(meta.last_log_id.map(|l| l.index()));
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, io::Error> {
        Ok(self
            .shared
            .store
            .load_snapshot()?
            .map(|(meta, snapshot)| Snapshot { meta, snapshot }))
    }
}
