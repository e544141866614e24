//! Live copies of a running VM (fork with memory, a snapshot of a running VM): its RAM
//! and writable disk are copied while it runs, and it stops only for what changed
//! meanwhile plus its device state.
//!
//! - RAM: QEMU's own live migration (its dirty-page log, the mechanism QEMU trusts for
//!   migrating running guests) streams the RAM to a *receiver*, a second QEMU of the
//!   same machine started with `-S -incoming defer` whose RAM is a new shared file. QEMU
//!   iterates until what is left fits in [`DOWNTIME_LIMIT_MS`], stops the source, and
//!   sends the rest. The receiver, whose guest never runs, then writes its device state
//!   with `x-ignore-shared`: its RAM file and that state are the source at the instant it
//!   stopped, the same pair a stop-and-copy snapshot gives.
//! - Disk: a dirty bitmap on the source's writable disk starts before the disk file is
//!   copied (sparse, while the VM runs); while the source is stopped (the migration's
//!   `pause-before-switchover`), an incremental backup job copies the blocks the bitmap
//!   marks into that copy, so it too is the disk at the stop instant.
//!
//! The soft-dirty bits of the QEMU process were the other candidate: this host's kernel
//! lacks `CONFIG_MEM_SOFT_DIRTY` (`clear_refs` 4 is accepted, pagemap bit 55 never set),
//! and a page written then evicted before it is read loses its bit anyway.
//!
//! Also chosen over copying the writable disk while stopped (ext4 has no reflink; 17 MiB of
//! an empty disk alone costs more than the pause's budget). Cost: QEMU's migration reads
//! every page, so the source's page cache holds its whole RAM afterwards (clean zero pages
//! where it never wrote; reclaimable), and the receiver's start (~100 ms) adds to the
//! fork's total.

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{
    Accel, Inner, QemuStart, RamMode, VmRecord, VmState, give, migrate_to_file, new_ram_file, pidfd_open,
    set_ignore_shared, sigkill, wait_ended,
};
use crate::vm::disks::{allocated_bytes, sparse_copy};
use crate::vm::qmp::{Qmp, QmpError};
use crate::vm::{VmError, io_err, net};

/// The stop QEMU aims at when it decides to switch over (the rest of the pause is the
/// device state and the disk blocks written during the copy).
const DOWNTIME_LIMIT_MS: u64 = 5;
/// A guest that dirties memory faster than it can be copied still converges: after
/// this long QEMU may stop it for longer.
const CONVERGE_PATIENCE: Duration = Duration::from_secs(10);
const RELAXED_DOWNTIME_MS: u64 = 1000;
/// Migration bandwidth: no throttle (both ends are on this host).
const MAX_BANDWIDTH: u64 = 64 << 30;
const BITMAP: &str = "opendsec-precopy";
const DISK_TARGET: &str = "opendsec-precopy-target";
const DISK_JOB: &str = "opendsec-precopy-disk";
const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// What a copy of a running VM did.
pub(super) struct LiveCopy {
    /// How long the source's vCPUs were stopped: from QEMU's `STOP` event to its
    /// `RESUME` event (their timestamps).
    pub source_paused: Duration,
    /// Bytes of RAM data in the copy's RAM file.
    pub ram_bytes: u64,
    /// Bytes of disk data in the copy's disk.
    pub disk_bytes: u64,
    /// Bytes of disk blocks written during the copy and copied again while stopped.
    pub disk_dirty_bytes: u64,
    /// The RAM is in `state` (a stop-and-copy of a VM with private RAM), not in `ram`.
    pub ram_in_stream: bool,
}

/// Whether `source` is copied live: QEMU's dirty-page log must be exact for it (see
/// [`super::TCG_RAM_TRIM_KB`]), and its disk a raw file (a full VM's qcow2 overlay cannot
/// be copied as a file while QEMU writes its metadata: it is copied stopped).
pub(super) fn live_copy_is_exact(source: &VmRecord) -> bool {
    (source.accel == Accel::Kvm || source.ram_trimmed) && source.machine == super::Machine::Microvm
}

impl Inner {
    /// Copies the running VM `source` into `dest`: live where that is exact, else
    /// stopped for the whole copy (VMs made under TCG before their RAM was trimmed).
    pub(super) fn copy_running(&self, source: &VmRecord, dest: &Path) -> Result<LiveCopy, VmError> {
        if live_copy_is_exact(source) {
            self.live_copy(source, dest)
        } else {
            self.stop_and_copy(source, dest)
        }
    }

    /// The source stops while its device state is streamed and its RAM file (shared
    /// RAM; private RAM goes into the stream) and disk are copied, then continues.
    fn stop_and_copy(&self, source: &VmRecord, dest: &Path) -> Result<LiveCopy, VmError> {
        let dir = self.vm_dir(&source.id);
        let mut qmp = self.qmp(source)?;
        let shared = source.ram == RamMode::Shared;
        set_ignore_shared(&mut qmp, shared)?;
        qmp.execute("stop", json!({}))?;
        let copied = (|| {
            migrate_to_file(&mut qmp, &dest.join("state"))?;
            let ram_bytes = if shared {
                sparse_copy(&dir.join("ram"), &dest.join("ram"))?
            } else {
                0
            };
            let disk_bytes = sparse_copy(&dir.join("rw.img"), &dest.join("rw.img"))?;
            Ok::<_, VmError>((ram_bytes, disk_bytes))
        })();
        // The source runs on whatever happened.
        let cont = qmp.execute("cont", json!({}));
        let (ram_bytes, disk_bytes) = copied?;
        cont?;
        let stop = qmp.wait_event("STOP", Duration::from_secs(5))?;
        let resume = qmp.wait_event("RESUME", Duration::from_secs(5))?;
        Ok(LiveCopy {
            source_paused: event_time(&resume).saturating_sub(event_time(&stop)),
            ram_bytes,
            disk_bytes,
            disk_dirty_bytes: 0,
            ram_in_stream: !shared,
        })
    }

    /// Copies the running VM `source` into `dest` (an existing directory): `ram` (a RAM
    /// file, root's), `state` (device state, `x-ignore-shared`) and `rw.img`, as they were
    /// at one instant. The source runs on whatever happens; on failure `dest` may hold
    /// partial files. The caller holds the source's lock.
    pub(super) fn live_copy(&self, source: &VmRecord, dest: &Path) -> Result<LiveCopy, VmError> {
        let receivers = self.cfg.root.join("receivers");
        fs::create_dir_all(&receivers).map_err(io_err(format!("creating {}", receivers.display())))?;
        fs::set_permissions(&receivers, fs::Permissions::from_mode(0o711))
            .map_err(io_err(format!("chmod {}", receivers.display())))?;
        let (recv_dir, netns) = self.receiver_of(&source.id);
        // What a crash in the middle of an earlier copy left.
        self.discard(&recv_dir, Some(&netns), None);
        let result = self.live_copy_through(source, dest, &recv_dir, &netns);
        self.discard(&recv_dir, Some(&netns), None);
        result
    }

    /// The directory and namespace of VM `id`'s receiver.
    fn receiver_of(&self, id: &str) -> (std::path::PathBuf, String) {
        // '.' is not allowed in VM ids: no VM's namespace has this name.
        (
            self.cfg.root.join("receivers").join(id),
            format!("{}{id}.r", self.netns_prefix),
        )
    }

    /// Ends the receiver a live copy of VM `id` left (the caller holds the VM's lock,
    /// so no copy is under way).
    pub(super) fn discard_receiver(&self, id: &str) {
        let (dir, netns) = self.receiver_of(id);
        if dir.exists() || net::netns_path(&netns).exists() {
            self.discard(&dir, Some(&netns), None);
        }
    }

    fn live_copy_through(
        &self,
        source: &VmRecord,
        dest: &Path,
        recv_dir: &Path,
        netns: &str,
    ) -> Result<LiveCopy, VmError> {
        let source_dir = self.vm_dir(&source.id);
        // The receiver: the source's machine as the source's uid (it holds the same
        // memory), in a namespace of its own (the source's tap is in use).
        fs::create_dir(recv_dir).map_err(io_err(format!("creating {}", recv_dir.display())))?;
        self.prepare_dir(recv_dir, source.uid)?;
        link_or_copy(&source_dir.join("initrd"), &recv_dir.join("initrd"))?;
        new_ram_file(&recv_dir.join("ram"), source.memory_mb)?;
        give(&recv_dir.join("ram"), source.uid, source.uid, 0o600)?;
        // The receiver's guest never runs: its disk is a placeholder of the right size.
        let disk_len = fs::metadata(source_dir.join("rw.img"))
            .map_err(io_err("reading the source's disk"))?
            .len();
        new_sparse_file(&recv_dir.join("rw.img"), disk_len)?;
        give(&recv_dir.join("rw.img"), source.uid, source.uid, 0o600)?;
        net::create(netns, source.uid)?;
        let record = VmRecord {
            netns: netns.into(),
            ram: RamMode::Shared,
            groups: Vec::new(),
            state: VmState::Running,
            pid: None,
            pid_start: None,
            ..source.clone()
        };
        // A cgroup of its own: it holds a whole copy of the RAM, beyond the source's limit.
        let recv_pid = self.spawn_qemu(recv_dir, &record, QemuStart::Receive, &self.receiver_cgroup(&source.id))?;
        let mut recv = self.connect_started(recv_dir, &record, recv_pid)?;

        let mut qmp = self.qmp(source)?;
        let _ = qmp.execute("block-dirty-bitmap-remove", json!({"node": "rw", "name": BITMAP}));
        qmp.execute(
            "block-dirty-bitmap-add",
            json!({"node": "rw", "name": BITMAP, "granularity": 65536}),
        )?;
        let copied = self.copy_while_running(&mut qmp, &mut recv, &source_dir, dest);
        if copied.is_err() {
            cancel_and_continue(&mut qmp);
        }
        let _ = qmp.execute("block-dirty-bitmap-remove", json!({"node": "rw", "name": BITMAP}));
        let _ = qmp.execute(
            "migrate-set-capabilities",
            json!({"capabilities": [{"capability": "pause-before-switchover", "state": false}]}),
        );
        drop(qmp);
        let (source_paused, disk_bytes, disk_dirty_bytes) = copied?;

        // The receiver holds the RAM; its device state is the source's at the stop.
        wait_incoming(&mut recv)?;
        set_ignore_shared(&mut recv, true)?;
        migrate_to_file(&mut recv, &dest.join("state"))?;
        let _ = recv.execute("quit", json!({}));
        drop(recv);
        if let Some(pidfd) = pidfd_open(recv_pid)
            && !wait_ended(recv_dir, recv_pid, &pidfd, Duration::from_secs(10))
        {
            sigkill(&pidfd);
            wait_ended(recv_dir, recv_pid, &pidfd, Duration::from_secs(10));
        }
        let ram = dest.join("ram");
        if fs::rename(recv_dir.join("ram"), &ram).is_err() {
            // Another file system.
            sparse_copy(&recv_dir.join("ram"), &ram)?;
        }
        give(&ram, 0, 0, 0o600)?;
        Ok(LiveCopy {
            source_paused,
            ram_bytes: allocated_bytes(&ram),
            disk_bytes,
            disk_dirty_bytes,
            ram_in_stream: false,
        })
    }

    /// Copies the disk, migrates the RAM to the receiver, and at the switch-over (the
    /// source stopped) copies the disk blocks written meanwhile, then continues the
    /// source. Returns the pause and the disk's bytes (all, and copied while stopped).
    fn copy_while_running(
        &self,
        qmp: &mut Qmp,
        recv: &mut Qmp,
        source_dir: &Path,
        dest: &Path,
    ) -> Result<(Duration, u64, u64), VmError> {
        let disk = dest.join("rw.img");
        let disk_bytes = sparse_copy(&source_dir.join("rw.img"), &disk)?;

        let (ours, theirs) = UnixStream::pair().map_err(io_err("a socket pair"))?;
        set_ignore_shared(recv, false)?;
        recv.execute_with_fd("getfd", json!({"fdname": "precopy"}), theirs.as_raw_fd())?;
        recv.execute("migrate-incoming", json!({"uri": "fd:precopy"}))?;
        drop(theirs);
        qmp.execute(
            "migrate-set-capabilities",
            json!({"capabilities": [
                {"capability": "x-ignore-shared", "state": false},
                {"capability": "pause-before-switchover", "state": true},
                {"capability": "events", "state": true},
            ]}),
        )?;
        qmp.execute(
            "migrate-set-parameters",
            json!({"downtime-limit": DOWNTIME_LIMIT_MS, "max-bandwidth": MAX_BANDWIDTH}),
        )?;
        qmp.execute_with_fd("getfd", json!({"fdname": "precopy"}), ours.as_raw_fd())?;
        drop(ours);
        // The stop flushes the disk: let most of that happen now.
        if let Ok(f) = fs::File::open(source_dir.join("rw.img")) {
            let _ = f.sync_data();
        }
        qmp.execute("migrate", json!({"uri": "fd:precopy"}))?;

        // Iterations run until QEMU stops the source and waits before switching over.
        let started = Instant::now();
        let mut relaxed = false;
        loop {
            match qmp.wait_event("MIGRATION", Duration::from_secs(1)) {
                Ok(event) => match event["data"]["status"].as_str().unwrap_or("") {
                    "pre-switchover" => break,
                    "failed" | "cancelled" => return Err(migration_failed(qmp, "the live copy")),
                    _ => {}
                },
                Err(QmpError::Timeout(_)) => {}
                Err(e) => return Err(e.into()),
            }
            if !relaxed && started.elapsed() > CONVERGE_PATIENCE {
                qmp.execute("migrate-set-parameters", json!({"downtime-limit": RELAXED_DOWNTIME_MS}))?;
                relaxed = true;
            }
            if started.elapsed() > STEP_TIMEOUT {
                return Err(VmError::Timeout {
                    what: "the live copy's RAM".into(),
                    seconds: STEP_TIMEOUT.as_secs(),
                });
            }
        }
        // Stopped: the disk blocks written since the bitmap began.
        let dirty = bitmap_dirty_bytes(qmp)?;
        if dirty > 0 {
            copy_dirty_blocks(qmp, &disk)?;
        }
        qmp.execute("migrate-continue", json!({"state": "pre-switchover"}))?;
        loop {
            let event = qmp.wait_event("MIGRATION", STEP_TIMEOUT)?;
            match event["data"]["status"].as_str().unwrap_or("") {
                "completed" => break,
                "failed" | "cancelled" => return Err(migration_failed(qmp, "the live copy")),
                _ => {}
            }
        }
        continue_after_migration(qmp)?;
        let stop = qmp.wait_event("STOP", Duration::from_secs(5))?;
        let resume = qmp.wait_event("RESUME", Duration::from_secs(5))?;
        let source_paused = event_time(&resume).saturating_sub(event_time(&stop));
        Ok((source_paused, disk_bytes, dirty))
    }
}

/// `cont` once QEMU has finalized the completed migration (its `completed` event comes
/// a moment before it accepts `cont`).
fn continue_after_migration(qmp: &mut Qmp) -> Result<(), VmError> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match qmp.execute("cont", json!({})) {
            Ok(_) => return Ok(()),
            Err(QmpError::Command { desc, .. }) if desc.contains("not finalized") && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_micros(200));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// A migration gone wrong: QEMU's reason.
fn migration_failed(qmp: &mut Qmp, what: &str) -> VmError {
    let desc = qmp
        .execute("query-migrate", json!({}))
        .ok()
        .and_then(|info| info["error-desc"].as_str().map(str::to_string))
        .unwrap_or_else(|| "migration failed".into());
    VmError::Qmp(QmpError::Command {
        command: "migrate".into(),
        class: "failed".into(),
        desc: format!("{what}: {desc}"),
    })
}

/// Whether an outgoing migration is under way.
pub(super) fn migration_under_way(qmp: &mut Qmp) -> bool {
    qmp.execute("query-migrate", json!({})).is_ok_and(|info| {
        matches!(
            info["status"].as_str(),
            Some("setup" | "active" | "cancelling" | "pre-switchover" | "device")
        )
    })
}

/// After a failed live copy: no migration left under way, the source running.
pub(super) fn cancel_and_continue(qmp: &mut Qmp) {
    let _ = qmp.execute("migrate_cancel", json!({}));
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && migration_under_way(qmp) {
        std::thread::sleep(Duration::from_millis(2));
    }
    let _ = qmp.execute("block-job-cancel", json!({"device": DISK_JOB, "force": true}));
    let _ = qmp.execute("blockdev-del", json!({"node-name": DISK_TARGET}));
    let running = qmp
        .execute("query-status", json!({}))
        .is_ok_and(|s| s["status"] == "running");
    if !running {
        let _ = qmp.execute("cont", json!({}));
    }
}

/// Waits until the receiver has loaded the whole stream.
fn wait_incoming(recv: &mut Qmp) -> Result<(), VmError> {
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        let info = recv.execute("query-migrate", json!({}))?;
        match info["status"].as_str() {
            Some("completed") => return Ok(()),
            Some("failed") | Some("cancelled") => {
                return Err(migration_failed(recv, "the live copy's receiver"));
            }
            _ if Instant::now() > deadline => {
                return Err(VmError::Timeout {
                    what: "the live copy's receiver".into(),
                    seconds: STEP_TIMEOUT.as_secs(),
                });
            }
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// Bytes the dirty bitmap of the writable disk marks.
fn bitmap_dirty_bytes(qmp: &mut Qmp) -> Result<u64, VmError> {
    let blocks = qmp.execute("query-block", json!({}))?;
    let device = blocks.as_array().into_iter().flatten().find(|d| d["device"] == "rw");
    let bitmaps = device.into_iter().flat_map(|d| {
        [&d["inserted"]["dirty-bitmaps"], &d["dirty-bitmaps"]]
            .into_iter()
            .filter_map(Value::as_array)
            .flatten()
    });
    for bitmap in bitmaps {
        if bitmap["name"] == BITMAP {
            return Ok(bitmap["count"].as_u64().unwrap_or(0));
        }
    }
    Err(VmError::Qmp(QmpError::Protocol(format!(
        "no dirty bitmap {BITMAP} on the writable disk"
    ))))
}

/// Copies the blocks the bitmap marks from the (stopped) source's disk into `target`,
/// a copy of that disk taken while the bitmap was on: an incremental backup job.
fn copy_dirty_blocks(qmp: &mut Qmp, target: &Path) -> Result<(), VmError> {
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(target)
        .map_err(io_err(format!("opening {}", target.display())))?;
    let set = qmp.execute_with_fd("add-fd", json!({"opaque": "opendsec live copy disk"}), file.as_raw_fd())?;
    let fdset = set["fdset-id"]
        .as_u64()
        .ok_or_else(|| VmError::Qmp(QmpError::Protocol(format!("add-fd answered {set}"))))?;
    let result = (|| {
        qmp.execute(
            "blockdev-add",
            json!({
                "node-name": DISK_TARGET,
                "driver": "raw",
                "file": {"driver": "file", "filename": format!("/dev/fdset/{fdset}")},
            }),
        )?;
        let job = (|| {
            qmp.execute(
                "blockdev-backup",
                json!({
                    "job-id": DISK_JOB,
                    "device": "rw",
                    "target": DISK_TARGET,
                    "sync": "incremental",
                    "bitmap": BITMAP,
                }),
            )?;
            let done = qmp.wait_event("BLOCK_JOB_COMPLETED", STEP_TIMEOUT)?;
            match done["data"]["error"].as_str() {
                Some(error) => Err(VmError::Qmp(QmpError::Command {
                    command: "blockdev-backup".into(),
                    class: "failed".into(),
                    desc: error.into(),
                })),
                None => Ok(()),
            }
        })();
        let removed = qmp.execute("blockdev-del", json!({"node-name": DISK_TARGET}));
        job?;
        removed?;
        Ok::<_, VmError>(())
    })();
    let _ = qmp.execute("remove-fd", json!({"fdset-id": fdset}));
    result
}

/// A QMP event's timestamp.
fn event_time(event: &Value) -> Duration {
    let t = &event["timestamp"];
    Duration::from_secs(t["seconds"].as_u64().unwrap_or(0))
        + Duration::from_micros(t["microseconds"].as_u64().unwrap_or(0))
}

/// A hard link of `src` at `dst` (no data copied), or a copy on another file system.
pub(super) fn link_or_copy(src: &Path, dst: &Path) -> Result<(), VmError> {
    if fs::hard_link(src, dst).is_ok() {
        return Ok(());
    }
    fs::copy(src, dst)
        .map(|_| ())
        .map_err(io_err(format!("copying {} to {}", src.display(), dst.display())))
}

fn new_sparse_file(path: &Path, len: u64) -> Result<(), VmError> {
    let file = fs::File::create(path).map_err(io_err(format!("creating {}", path.display())))?;
    file.set_len(len).map_err(io_err(format!("sizing {}", path.display())))
}
