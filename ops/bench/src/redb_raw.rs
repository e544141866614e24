//! Baseline (a): a raw durable redb commit of the same payload on the same disk.
//! Each write is one write transaction inserting the payload under an increasing u64
//! key, committed with `Durability::Immediate`. Writes run on the blocking pool, so at
//! concurrency > 1 they contend on redb's single writer, which is what a raw durable
//! commit costs at that concurrency (no batching).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};
use tempfile::TempDir;

use crate::load::{BoxFuture, WriteTarget};
use crate::targets::{ReplaySource, Session, SetupCtx};

const TABLE: TableDefinition<u64, &[u8]> = TableDefinition::new("bench");

pub struct RedbRaw {
    db: Arc<Database>,
    /// Next key: increasing across all runs on this database (never overwrites).
    next_key: AtomicU64,
    // Dropped after `db`: removes the database file.
    _dir: TempDir,
}

impl RedbRaw {
    pub fn create(ctx: &SetupCtx) -> Result<Self, String> {
        std::fs::create_dir_all(&ctx.data_dir).map_err(|e| format!("create {:?}: {e}", ctx.data_dir))?;
        let dir = tempfile::Builder::new()
            .prefix("redb-raw-")
            .tempdir_in(&ctx.data_dir)
            .map_err(|e| format!("tempdir in {:?}: {e}", ctx.data_dir))?;
        let db = Database::create(dir.path().join("bench.redb")).map_err(|e| e.to_string())?;
        Ok(RedbRaw {
            db: Arc::new(db),
            next_key: AtomicU64::new(0),
            _dir: dir,
        })
    }
}

pub async fn setup(ctx: SetupCtx) -> Result<Session, String> {
    let t = Arc::new(RedbRaw::create(&ctx)?);
    Ok(Session::new(t.clone()).with_replay(t))
}

fn put(db: &Database, key: u64, value: &[u8]) -> Result<(), redb::Error> {
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)?;
    {
        let mut t = txn.open_table(TABLE)?;
        t.insert(key, value)?;
    }
    txn.commit()?;
    Ok(())
}

impl WriteTarget for RedbRaw {
    fn name(&self) -> String {
        "redb raw".into()
    }
    fn write(&self, _worker: usize, _seq: u64, payload: Vec<u8>) -> BoxFuture<'_, Result<(), String>> {
        let db = self.db.clone();
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        Box::pin(async move {
            tokio::task::spawn_blocking(move || put(&db, key, &payload).map_err(|e| e.to_string()))
                .await
                .map_err(|e| e.to_string())?
        })
    }
}

/// Baseline for replay speed: one read transaction scanning every stored payload.
impl ReplaySource for RedbRaw {
    fn name(&self) -> String {
        "redb raw scan".into()
    }
    fn replay(&self) -> BoxFuture<'_, Result<u64, String>> {
        let db = self.db.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || -> Result<u64, String> {
                let txn = db.begin_read().map_err(|e| e.to_string())?;
                let t = txn.open_table(TABLE).map_err(|e| e.to_string())?;
                let (mut n, mut sum) = (0u64, 0u64);
                for item in t.iter().map_err(|e| e.to_string())? {
                    let (_k, v) = item.map_err(|e| e.to_string())?;
                    sum = sum.wrapping_add(v.value().iter().map(|b| *b as u64).sum::<u64>());
                    n += 1;
                }
                std::hint::black_box(sum);
                Ok(n)
            })
            .await
            .map_err(|e| e.to_string())?
        })
    }
}
