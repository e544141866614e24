//! The seccomp profile of a container sandbox: an allow list. Sandbox code is hostile
//! and often root inside the sandbox, so the filter, not the capability set, is what
//! keeps it away from kernel interfaces it has no business with.
//!
//! - **Default: EPERM.** A syscall that no rule below allows fails with EPERM, as in
//!   Docker's default profile (moby `profiles/seccomp/default.json`), which is the
//!   reference for what ordinary programs need. That includes every syscall a newer
//!   kernel adds until it is listed here.
//! - **Allowed whatever the arguments:** [`ALLOWED`] (and [`ALLOWED_BEYOND_LIBC`]):
//!   Docker's unconditional x86_64 list minus `io_uring_*`, `name_to_handle_at`,
//!   `modify_ldt` (16-bit segments: Wine and DOS emulators, a record of kernel bugs) and
//!   the unimplemented `epoll_*_old`; of Docker's capability-gated entries only `chroot`
//!   (CAP_SYS_CHROOT is kept); plus recent harmless syscalls (`fchmodat2`, whose ENOSYS
//!   newer glibc needs to fall back, `cachestat`, `map_shadow_stack`, the `futex_*`
//!   family, `mseal`, the `*xattrat` family, `file_getattr`/`file_setattr`).
//! - **Allowed with conditions on the arguments:**
//!   `clone` and `unshare` only without any `CLONE_NEW*` flag (no new namespaces, so no
//!   user namespace in which root would regain capabilities; Docker allows `unshare`
//!   only with CAP_SYS_ADMIN, but without those flags it only stops sharing what the
//!   caller shares: file table, fs info, SysV semaphores); `personality` only with
//!   the values Docker allows (Linux, Linux32, UNAME26 and the query `0xffffffff`:
//!   not READ_IMPLIES_EXEC, ADDR_NO_RANDOMIZE, MMAP_PAGE_ZERO...); `socket` only for
//!   AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK and `socketpair` only for AF_UNIX (no
//!   AF_VSOCK, which reaches the host's and the microVMs' vsock, and none of the rare
//!   families whose modules the kernel would load on demand); `ioctl` with every
//!   request but [`DENIED_IOCTLS`] (TIOCSTI pushes input into a terminal, TIOCLINUX
//!   drives the virtual console, TIOCSETD changes a terminal's line discipline and
//!   loads its module).
//! - **`clone3` fails with ENOSYS**: its flags are in memory, where seccomp cannot read
//!   them; libc takes ENOSYS as "old kernel" and falls back to `clone`.
//! - **Refused** (not listed), among others, [`DENIED`]: io_uring, userfaultfd, keyrings,
//!   perf, BPF, modules, kexec, every mount call and the new mount API, pivot_root,
//!   setns, ptrace, process_vm_*, kcmp, pidfd_getfd, handle-based opens, swap, reboot,
//!   acct, quotas, iopl/ioperm, uselib, vhangup, clock setting, syslog, NUMA policy.
//!
//! **Every refusal is the default action, never a rule.** crun drops any rule whose
//! action equals the default (libseccomp refuses to add one), so "allow `ioctl`" plus
//! "EPERM when the request is TIOCSTI" would silently leave TIOCSTI allowed. Each
//! conditional case is therefore written as allow rules whose union is exactly what may
//! pass: for `ioctl`, [`complement_cover`] gives masked-equality rules matching every
//! request except the denied ones. crun also turns two conditions on one argument of a
//! rule into two separate (ORed) rules, so no rule here has two conditions on the same
//! argument, and no syscall has both an unconditional and a conditional rule (tests).
//!
//! **Argument width.** Seccomp compares the full 64-bit register, while the kernel reads
//! an ioctl request, a socket family and a personality as 32-bit values (musl even
//! sign-extends them). Those rules compare only the low 32 bits (`SCMP_CMP_MASKED_EQ`
//! with masks inside `0xffffffff`): junk in the upper half neither slips a denied
//! request through nor breaks an allowed one.
//!
//! **Architectures: x86_64 only.** The 32-bit x86 ABI (a 32-bit program, or `int 0x80`
//! from a 64-bit one) and x32 are left out of the filter, so their syscalls get
//! the bad-architecture action: the calling thread is killed by SIGSYS (crun and runc).
//! Nothing the sandboxes run is 32-bit, and keeping that ABI would weaken the rules:
//! it multiplexes sockets and SysV IPC through `socketcall` and `ipc`, whose real
//! arguments sit in memory where seccomp cannot check them (the socket-family rule could
//! not hold), doubles every rule under other numbers, and the compat entry path has had
//! its own share of kernel bugs.
//!
//! **The runtime's libseccomp resolves names.** A name it does not know is left out of
//! the filter, so that syscall stays refused: Debian 12's libseccomp (2.5.4-1+deb12u1) knows up to
//! `futex_requeue` (456), so `mseal`, the `*xattrat` family and `file_getattr`/
//! `file_setattr` get EPERM under crun and ENOSYS under runc (which answers ENOSYS for
//! numbers above the highest it knows). A newer libseccomp enables them with no change
//! here.

use oci_spec::runtime::{
    Arch, LinuxSeccomp, LinuxSeccompAction, LinuxSeccompArgBuilder, LinuxSeccompBuilder, LinuxSeccompOperator,
    LinuxSyscall, LinuxSyscallBuilder,
};

use super::ContainerError;

/// A syscall by name, with its x86_64 number (the profile uses names; tests use numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sys {
    pub name: &'static str,
    pub nr: i64,
}

/// `"SYS_read"` -> `"read"`, at compile time.
const fn strip_sys(s: &'static str) -> &'static str {
    let (_, rest) = s.as_bytes().split_at(4);
    match std::str::from_utf8(rest) {
        Ok(name) => name,
        Err(_) => panic!("a syscall name is ASCII"),
    }
}

/// `sys![SYS_read, ...]`: the compiler checks that each is an x86_64 syscall of libc.
macro_rules! sys {
    ($($n:ident),* $(,)?) => {
        &[$(Sys { name: strip_sys(stringify!($n)), nr: libc::$n }),*]
    };
}

/// Allowed whatever their arguments.
#[rustfmt::skip]
pub const ALLOWED: &[Sys] = sys![
    // Files and directories.
    SYS_read, SYS_write, SYS_open, SYS_openat, SYS_openat2, SYS_creat, SYS_close, SYS_close_range,
    SYS_lseek, SYS_pread64, SYS_pwrite64, SYS_readv, SYS_writev, SYS_preadv, SYS_pwritev,
    SYS_preadv2, SYS_pwritev2, SYS_sendfile, SYS_splice, SYS_tee, SYS_vmsplice, SYS_copy_file_range,
    SYS_stat, SYS_fstat, SYS_lstat, SYS_newfstatat, SYS_statx, SYS_statfs, SYS_fstatfs,
    SYS_access, SYS_faccessat, SYS_faccessat2, SYS_getdents, SYS_getdents64, SYS_getcwd,
    SYS_chdir, SYS_fchdir, SYS_chroot, SYS_rename, SYS_renameat, SYS_renameat2, SYS_mkdir,
    SYS_mkdirat, SYS_rmdir, SYS_link, SYS_linkat, SYS_unlink, SYS_unlinkat, SYS_symlink,
    SYS_symlinkat, SYS_readlink, SYS_readlinkat, SYS_mknod, SYS_mknodat, SYS_chmod, SYS_fchmod,
    SYS_fchmodat, SYS_fchmodat2, SYS_chown, SYS_fchown, SYS_lchown, SYS_fchownat, SYS_umask,
    SYS_truncate, SYS_ftruncate, SYS_fallocate, SYS_fadvise64, SYS_readahead, SYS_fsync,
    SYS_fdatasync, SYS_sync, SYS_syncfs, SYS_sync_file_range, SYS_flock, SYS_fcntl, SYS_utime,
    SYS_utimes, SYS_utimensat, SYS_futimesat, SYS_setxattr, SYS_lsetxattr, SYS_fsetxattr,
    SYS_getxattr, SYS_lgetxattr, SYS_fgetxattr, SYS_listxattr, SYS_llistxattr, SYS_flistxattr,
    SYS_removexattr, SYS_lremovexattr, SYS_fremovexattr, SYS_inotify_init, SYS_inotify_init1,
    SYS_inotify_add_watch, SYS_inotify_rm_watch, SYS_fanotify_mark, SYS_dup, SYS_dup2, SYS_dup3,
    SYS_pipe, SYS_pipe2,
    // Linux AIO (io_uring is refused).
    SYS_io_setup, SYS_io_destroy, SYS_io_submit, SYS_io_cancel, SYS_io_getevents,
    // Waiting for events.
    SYS_poll, SYS_ppoll, SYS_select, SYS_pselect6, SYS_epoll_create, SYS_epoll_create1,
    SYS_epoll_ctl, SYS_epoll_wait, SYS_epoll_pwait, SYS_epoll_pwait2, SYS_eventfd, SYS_eventfd2,
    SYS_signalfd, SYS_signalfd4, SYS_timerfd_create, SYS_timerfd_settime, SYS_timerfd_gettime,
    // Memory.
    SYS_brk, SYS_mmap, SYS_munmap, SYS_mremap, SYS_mprotect, SYS_madvise, SYS_msync, SYS_mincore,
    SYS_mlock, SYS_mlock2, SYS_munlock, SYS_mlockall, SYS_munlockall, SYS_remap_file_pages,
    SYS_memfd_create, SYS_memfd_secret, SYS_membarrier, SYS_pkey_alloc, SYS_pkey_free,
    SYS_pkey_mprotect, SYS_mseal,
    // Processes and threads (clone and unshare: see the conditional rules).
    SYS_fork, SYS_vfork, SYS_execve, SYS_execveat, SYS_exit, SYS_exit_group, SYS_wait4,
    SYS_waitid, SYS_getpid, SYS_getppid, SYS_gettid, SYS_set_tid_address, SYS_set_robust_list,
    SYS_get_robust_list, SYS_rseq, SYS_arch_prctl, SYS_prctl, SYS_set_thread_area,
    SYS_get_thread_area, SYS_futex, SYS_futex_waitv, SYS_sched_yield, SYS_sched_getaffinity,
    SYS_sched_setaffinity, SYS_sched_getparam, SYS_sched_setparam, SYS_sched_getscheduler,
    SYS_sched_setscheduler, SYS_sched_getattr, SYS_sched_setattr, SYS_sched_get_priority_max,
    SYS_sched_get_priority_min, SYS_sched_rr_get_interval, SYS_getpriority, SYS_setpriority,
    SYS_ioprio_get, SYS_ioprio_set, SYS_getrlimit, SYS_setrlimit, SYS_prlimit64, SYS_getrusage,
    SYS_times, SYS_getcpu, SYS_pidfd_open, SYS_pidfd_send_signal, SYS_process_mrelease,
    SYS_seccomp, SYS_landlock_create_ruleset, SYS_landlock_add_rule, SYS_landlock_restrict_self,
    // Identity: root in the sandbox may change users (capabilities bound what it gains).
    SYS_getuid, SYS_geteuid, SYS_getgid, SYS_getegid, SYS_getresuid, SYS_getresgid,
    SYS_getgroups, SYS_setuid, SYS_setgid, SYS_setreuid, SYS_setregid, SYS_setresuid,
    SYS_setresgid, SYS_setgroups, SYS_setfsuid, SYS_setfsgid, SYS_capget, SYS_capset,
    SYS_getpgid, SYS_setpgid, SYS_getpgrp, SYS_getsid, SYS_setsid,
    // Signals.
    SYS_kill, SYS_tkill, SYS_tgkill, SYS_rt_sigaction, SYS_rt_sigprocmask, SYS_rt_sigreturn,
    SYS_rt_sigpending, SYS_rt_sigtimedwait, SYS_rt_sigqueueinfo, SYS_rt_tgsigqueueinfo,
    SYS_rt_sigsuspend, SYS_sigaltstack, SYS_pause, SYS_restart_syscall,
    // Time (reading it; setting the clock is refused).
    SYS_time, SYS_gettimeofday, SYS_clock_gettime, SYS_clock_getres, SYS_clock_nanosleep,
    SYS_nanosleep, SYS_adjtimex, SYS_clock_adjtime, SYS_alarm, SYS_getitimer, SYS_setitimer,
    SYS_timer_create, SYS_timer_settime, SYS_timer_gettime, SYS_timer_getoverrun, SYS_timer_delete,
    // Sockets (socket and socketpair: see the conditional rules).
    SYS_bind, SYS_listen, SYS_accept, SYS_accept4, SYS_connect, SYS_shutdown, SYS_getsockname,
    SYS_getpeername, SYS_getsockopt, SYS_setsockopt, SYS_sendto, SYS_recvfrom, SYS_sendmsg,
    SYS_recvmsg, SYS_sendmmsg, SYS_recvmmsg,
    // System V and POSIX IPC (the sandbox has its own IPC namespace).
    SYS_shmget, SYS_shmat, SYS_shmdt, SYS_shmctl, SYS_semget, SYS_semop, SYS_semtimedop,
    SYS_semctl, SYS_msgget, SYS_msgsnd, SYS_msgrcv, SYS_msgctl, SYS_mq_open, SYS_mq_unlink,
    SYS_mq_timedsend, SYS_mq_timedreceive, SYS_mq_notify, SYS_mq_getsetattr,
    // The system (read only).
    SYS_uname, SYS_sysinfo, SYS_getrandom,
];

/// Allowed whatever their arguments, but not (yet) named by the libc crate: numbers from
/// the kernel's `arch/x86/entry/syscalls/syscall_64.tbl`.
#[rustfmt::skip]
pub const ALLOWED_BEYOND_LIBC: &[Sys] = &[
    Sys { name: "io_pgetevents", nr: 333 },
    Sys { name: "cachestat", nr: 451 },
    Sys { name: "map_shadow_stack", nr: 453 },
    Sys { name: "futex_wake", nr: 454 },
    Sys { name: "futex_wait", nr: 455 },
    Sys { name: "futex_requeue", nr: 456 },
    Sys { name: "setxattrat", nr: 463 },
    Sys { name: "getxattrat", nr: 464 },
    Sys { name: "listxattrat", nr: 465 },
    Sys { name: "removexattrat", nr: 466 },
    Sys { name: "file_getattr", nr: 468 },
    Sys { name: "file_setattr", nr: 469 },
];

/// Refused with EPERM, for root in the sandbox too: no rule allows them, so the default
/// action applies. Listed for the record and for the tests; not exhaustive (whatever is
/// not allowed is refused).
#[rustfmt::skip]
pub const DENIED: &[Sys] = sys![
    // Kernel interfaces with a long record of exploitable bugs that sandbox code does
    // not need (Docker refuses io_uring too; programs fall back to ordinary I/O).
    SYS_io_uring_setup, SYS_io_uring_enter, SYS_io_uring_register, SYS_userfaultfd,
    SYS_keyctl, SYS_add_key, SYS_request_key, SYS_perf_event_open, SYS_bpf, SYS_lookup_dcookie,
    SYS_fanotify_init,
    // The machine: modules, kexec, reboot, swap, accounting, quotas, the kernel log,
    // the clock, host names (the UTS namespace is set by the edge), NUMA placement.
    SYS_init_module, SYS_finit_module, SYS_delete_module, SYS_kexec_load, SYS_kexec_file_load,
    SYS_reboot, SYS_swapon, SYS_swapoff, SYS_acct, SYS_quotactl, SYS_quotactl_fd, SYS_syslog,
    SYS_settimeofday, SYS_clock_settime, SYS_sethostname, SYS_setdomainname, SYS_mbind,
    SYS_set_mempolicy, SYS_get_mempolicy, SYS_set_mempolicy_home_node, SYS_migrate_pages,
    SYS_move_pages,
    // Mounts and namespaces (clone and unshare without CLONE_NEW* flags are allowed).
    SYS_mount, SYS_umount2, SYS_fsopen, SYS_fsconfig, SYS_fsmount, SYS_fspick, SYS_move_mount,
    SYS_open_tree, SYS_mount_setattr, SYS_pivot_root, SYS_setns,
    // Other processes' memory and files (no CAP_SYS_PTRACE in the sandbox).
    SYS_ptrace, SYS_process_vm_readv, SYS_process_vm_writev, SYS_kcmp, SYS_pidfd_getfd,
    SYS_process_madvise,
    // Opening files by handle escapes the mount tree; naming handles is its first half.
    SYS_name_to_handle_at, SYS_open_by_handle_at,
    // Hardware and legacy: I/O ports, the LDT, a.out libraries, terminal hangup, and
    // obsolete or unimplemented entries.
    SYS_iopl, SYS_ioperm, SYS_modify_ldt, SYS_uselib, SYS_vhangup, SYS__sysctl, SYS_ustat,
    SYS_sysfs, SYS_nfsservctl, SYS_vserver, SYS_afs_syscall, SYS_tuxcall, SYS_security,
    SYS_getpmsg, SYS_putpmsg, SYS_epoll_ctl_old, SYS_epoll_wait_old,
];

/// The `ioctl` requests refused with EPERM (compared on their low 32 bits): injecting
/// input into a terminal, driving the virtual console, changing a terminal's line
/// discipline (which loads that discipline's module).
pub const DENIED_IOCTLS: &[(&str, u32)] = &[
    ("TIOCSTI", libc::TIOCSTI as u32),
    ("TIOCLINUX", libc::TIOCLINUX as u32),
    ("TIOCSETD", libc::TIOCSETD as u32),
];

/// CLONE_NEWTIME (0x80) is not in the libc crate for x86_64; in `clone`'s flags that
/// bit belongs to the exit signal, where no valid signal sets it.
const CLONE_NEWTIME: u64 = 0x80;

/// The flags `clone` and `unshare` may not carry: every new namespace.
pub const NAMESPACE_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET) as u64
    | CLONE_NEWTIME;

/// `personality` values allowed (Docker's): PER_LINUX, PER_LINUX32, UNAME26,
/// UNAME26 | PER_LINUX32 and the query 0xffffffff.
pub const PERSONALITIES: &[u32] = &[0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

/// Socket families `socket` may open.
pub const SOCKET_FAMILIES: &[u32] = &[
    libc::AF_UNIX as u32,
    libc::AF_INET as u32,
    libc::AF_INET6 as u32,
    libc::AF_NETLINK as u32,
];

/// The low 32 bits of a syscall argument: what the kernel reads of an `int` argument.
const LOW_32: u64 = 0xffff_ffff;

fn invalid(e: impl std::fmt::Display) -> ContainerError {
    ContainerError::Invalid(format!("building the seccomp profile: {e}"))
}

/// A rule allowing `names` when argument `index` masked by `mask` equals `value` (or
/// whatever the arguments, without a condition).
fn allow(names: &[&str], condition: Option<(usize, u64, u64)>) -> Result<LinuxSyscall, ContainerError> {
    let mut rule = LinuxSyscallBuilder::default()
        .names(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .action(LinuxSeccompAction::ScmpActAllow);
    if let Some((index, mask, value)) = condition {
        rule = rule.args(vec![
            LinuxSeccompArgBuilder::default()
                .index(index)
                .value(mask)
                .value_two(value)
                .op(LinuxSeccompOperator::ScmpCmpMaskedEq)
                .build()
                .map_err(invalid)?,
        ]);
    }
    rule.build().map_err(invalid)
}

/// Masked-equality conditions `(mask, value)` on 32-bit values whose union is exactly
/// every value not in `denied`: walking the bits from the top, each branch that holds
/// no denied value becomes one condition (the bits above it fixed as on the way there).
/// At most 32 conditions per denied value.
pub fn complement_cover(denied: &[u32]) -> Vec<(u32, u32)> {
    fn walk(denied: &[u32], bit: u32, mask: u32, value: u32, out: &mut Vec<(u32, u32)>) {
        let b = 1u32 << bit;
        for side in [0, b] {
            let rest: Vec<u32> = denied.iter().copied().filter(|d| d & b == side).collect();
            if rest.is_empty() {
                out.push((mask | b, value | side));
            } else if bit > 0 {
                walk(&rest, bit - 1, mask | b, value | side, out);
            }
            // else: a denied value itself, which no condition may match.
        }
    }
    let mut out = Vec::new();
    walk(denied, 31, 0, 0, &mut out);
    out
}

/// The profile: see the module documentation.
pub fn profile() -> Result<LinuxSeccomp, ContainerError> {
    let names: Vec<&str> = ALLOWED.iter().chain(ALLOWED_BEYOND_LIBC).map(|s| s.name).collect();
    let mut syscalls = vec![allow(&names, None)?];
    for name in ["clone", "unshare"] {
        syscalls.push(allow(&[name], Some((0, NAMESPACE_FLAGS, 0)))?);
    }
    for &value in PERSONALITIES {
        syscalls.push(allow(&["personality"], Some((0, LOW_32, value as u64)))?);
    }
    for &family in SOCKET_FAMILIES {
        syscalls.push(allow(&["socket"], Some((0, LOW_32, family as u64)))?);
    }
    syscalls.push(allow(&["socketpair"], Some((0, LOW_32, libc::AF_UNIX as u64)))?);
    let denied: Vec<u32> = DENIED_IOCTLS.iter().map(|&(_, request)| request).collect();
    for (mask, value) in complement_cover(&denied) {
        syscalls.push(allow(&["ioctl"], Some((1, mask as u64, value as u64)))?);
    }
    syscalls.push(
        LinuxSyscallBuilder::default()
            .names(vec!["clone3".to_string()])
            .action(LinuxSeccompAction::ScmpActErrno)
            .errno_ret(libc::ENOSYS as u32)
            .build()
            .map_err(invalid)?,
    );
    LinuxSeccompBuilder::default()
        .default_action(LinuxSeccompAction::ScmpActErrno)
        .default_errno_ret(libc::EPERM as u32)
        .architectures(vec![Arch::ScmpArchX86_64])
        .syscalls(syscalls)
        .build()
        .map_err(invalid)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use oci_spec::runtime::LinuxSeccompArg;

    use super::*;

    #[derive(Debug, PartialEq, Eq, Clone, Copy)]
    enum Verdict {
        Allow,
        Errno(i32),
    }
    const EPERM: Verdict = Verdict::Errno(libc::EPERM);

    fn holds(arg: &LinuxSeccompArg, args: &[u64; 6]) -> bool {
        let x = args[arg.index()];
        match arg.op() {
            LinuxSeccompOperator::ScmpCmpMaskedEq => x & arg.value() == arg.value_two().unwrap_or(0),
            LinuxSeccompOperator::ScmpCmpEq => x == arg.value(),
            other => panic!("no such operator in the profile: {other:?}"),
        }
    }

    /// What the filter answers to `name(args)`, as libseccomp builds it from the rules:
    /// the action of a matching rule of that syscall, else the default.
    fn verdict(p: &LinuxSeccomp, name: &str, args: [u64; 6]) -> Verdict {
        let matching: Vec<Verdict> = p
            .syscalls()
            .iter()
            .flatten()
            .filter(|r| r.names().iter().any(|n| n == name))
            .filter(|r| r.args().iter().flatten().all(|a| holds(a, &args)))
            .map(|r| match r.action() {
                LinuxSeccompAction::ScmpActAllow => Verdict::Allow,
                LinuxSeccompAction::ScmpActErrno => Verdict::Errno(r.errno_ret().unwrap() as i32),
                other => panic!("no such action in the profile: {other:?}"),
            })
            .collect();
        assert!(
            matching.windows(2).all(|w| w[0] == w[1]),
            "{name}{args:?}: rules disagree: {matching:?}"
        );
        matching
            .first()
            .copied()
            .unwrap_or(Verdict::Errno(p.default_errno_ret().unwrap() as i32))
    }

    fn call(name: &str, a0: u64, a1: u64) -> Verdict {
        verdict(&profile().unwrap(), name, [a0, a1, 0, 0, 0, 0])
    }

    /// A deterministic stream of 64-bit values (xorshift).
    fn values(n: usize) -> impl Iterator<Item = u64> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        (0..n).map(move |_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
    }

    const CONDITIONAL: &[&str] = &[
        "clone",
        "unshare",
        "personality",
        "socket",
        "socketpair",
        "ioctl",
        "clone3",
    ];

    #[test]
    fn anything_not_allowed_gets_eperm_and_only_the_x86_64_abi_is_in_the_filter() {
        let p = profile().unwrap();
        assert_eq!(p.default_action(), LinuxSeccompAction::ScmpActErrno);
        assert_eq!(p.default_errno_ret(), Some(libc::EPERM as u32));
        assert_eq!(p.architectures().as_deref(), Some(&[Arch::ScmpArchX86_64][..]));
        assert_eq!(verdict(&p, "no_such_syscall", [0; 6]), EPERM);
    }

    #[test]
    fn every_denied_syscall_is_in_no_rule_and_fails_with_eperm_whatever_its_arguments() {
        let p = profile().unwrap();
        let named: HashSet<&str> = p
            .syscalls()
            .iter()
            .flatten()
            .flat_map(|r| r.names().iter().map(String::as_str))
            .collect();
        for s in DENIED {
            assert!(!named.contains(s.name), "{} is in a rule", s.name);
            for a in values(8) {
                assert_eq!(verdict(&p, s.name, [a, a >> 3, a >> 7, 0, 0, 0]), EPERM, "{}", s.name);
            }
        }
        // The ones this profile must refuse, checked by number too.
        let denied: HashSet<i64> = DENIED.iter().map(|s| s.nr).collect();
        for nr in [
            libc::SYS_io_uring_setup,
            libc::SYS_io_uring_enter,
            libc::SYS_io_uring_register,
            libc::SYS_userfaultfd,
            libc::SYS_keyctl,
            libc::SYS_add_key,
            libc::SYS_request_key,
            libc::SYS_perf_event_open,
            libc::SYS_bpf,
            libc::SYS_kexec_load,
            libc::SYS_kexec_file_load,
            libc::SYS_init_module,
            libc::SYS_finit_module,
            libc::SYS_delete_module,
            libc::SYS_mount,
            libc::SYS_umount2,
            libc::SYS_fsopen,
            libc::SYS_fsmount,
            libc::SYS_fsconfig,
            libc::SYS_fspick,
            libc::SYS_move_mount,
            libc::SYS_open_tree,
            libc::SYS_mount_setattr,
            libc::SYS_pivot_root,
            libc::SYS_ptrace,
            libc::SYS_process_vm_readv,
            libc::SYS_process_vm_writev,
            libc::SYS_setns,
            libc::SYS_swapon,
            libc::SYS_swapoff,
            libc::SYS_reboot,
            libc::SYS_acct,
            libc::SYS_quotactl,
            libc::SYS_lookup_dcookie,
            libc::SYS_name_to_handle_at,
            libc::SYS_open_by_handle_at,
            libc::SYS_iopl,
            libc::SYS_ioperm,
            libc::SYS_uselib,
            libc::SYS_vhangup,
            libc::SYS_kcmp,
        ] {
            assert!(denied.contains(&nr), "syscall {nr} is not in DENIED");
        }
    }

    #[test]
    fn the_lists_are_disjoint_and_name_each_syscall_once() {
        let all: Vec<&Sys> = ALLOWED.iter().chain(ALLOWED_BEYOND_LIBC).chain(DENIED).collect();
        let names: HashSet<&str> = all.iter().map(|s| s.name).collect();
        let numbers: HashSet<i64> = all.iter().map(|s| s.nr).collect();
        assert_eq!(names.len(), all.len(), "a name is listed twice");
        assert_eq!(numbers.len(), all.len(), "a number is listed twice");
        for name in CONDITIONAL {
            assert!(!names.contains(name), "{name} has its own rules");
        }
        assert!(ALLOWED.iter().all(|s| (0..512).contains(&s.nr)));
    }

    /// crun drops a rule whose action is the default one (libseccomp refuses it) and
    /// splits two conditions on one argument into two ORed rules; a syscall with both an
    /// unconditional and conditional rules would be left to how libseccomp merges them.
    /// None of that may happen here.
    #[test]
    fn no_rule_is_one_the_runtimes_would_drop_split_or_override() {
        let p = profile().unwrap();
        let mut unconditional = HashSet::new();
        let mut conditional = HashSet::new();
        for rule in p.syscalls().iter().flatten() {
            let is_default = rule.action() == LinuxSeccompAction::ScmpActErrno
                && rule.errno_ret().unwrap_or(libc::EPERM as u32) == libc::EPERM as u32;
            assert!(!is_default, "a rule with the default action: {rule:?}");
            let args = rule.args().clone().unwrap_or_default();
            let indexes: HashSet<usize> = args.iter().map(|a| a.index()).collect();
            assert_eq!(indexes.len(), args.len(), "two conditions on one argument: {rule:?}");
            for name in rule.names() {
                if args.is_empty() {
                    assert!(unconditional.insert(name.clone()), "{name} twice without conditions");
                } else {
                    conditional.insert(name.clone());
                }
            }
        }
        let both: Vec<_> = unconditional.intersection(&conditional).collect();
        assert!(both.is_empty(), "both with and without conditions: {both:?}");
    }

    /// What the agent (PID 1 of every container sandbox) calls: the union of `strace -f`
    /// over its test suites (process, filesystem, envd_compat, chronus, tunnel), plus
    /// what its code calls on paths those suites do not take.
    #[rustfmt::skip]
    const AGENT_SYSCALLS: &[&str] = &[
        "accept4", "access", "arch_prctl", "bind", "brk", "chdir", "close", "close_range",
        "connect", "dup2", "epoll_create1", "epoll_ctl", "epoll_wait", "eventfd2", "execve",
        "exit", "exit_group", "fcntl", "flistxattr", "fremovexattr", "fsetxattr", "futex",
        "getdents64", "geteuid", "getgroups", "getpid", "getrandom", "getsockopt", "gettid",
        "getxattr", "inotify_add_watch", "inotify_init1", "kill", "listen", "listxattr", "madvise",
        "mkdir", "mmap", "mprotect", "munmap", "newfstatat", "openat", "pipe2", "poll", "prctl",
        "pread64", "prlimit64", "read", "readlink", "recvfrom", "recvmsg", "rename", "rseq",
        "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sched_getaffinity", "sched_yield",
        "sendmsg", "sendto", "set_robust_list", "set_tid_address", "setfsgid", "setfsuid",
        "setgid", "setgroups", "setpgid", "setsid", "setsockopt", "setuid", "shutdown",
        "sigaltstack", "signalfd4", "statfs", "fstatfs", "statx", "unlink", "unlinkat", "wait4",
        "write", "writev", "fchmod", "fchownat", "ftruncate", "lseek", "clock_nanosleep",
        "nanosleep", "copy_file_range",
    ];

    #[test]
    fn every_syscall_the_agent_makes_is_allowed() {
        let p = profile().unwrap();
        for name in AGENT_SYSCALLS {
            assert_eq!(verdict(&p, name, [0; 6]), Verdict::Allow, "{name}");
        }
        // Threads (glibc tries clone3 first and takes ENOSYS as "use clone"), fork.
        let thread = (libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS
            | libc::CLONE_PARENT_SETTID
            | libc::CLONE_CHILD_CLEARTID) as u64;
        let fork = (libc::CLONE_CHILD_CLEARTID | libc::CLONE_CHILD_SETTID | libc::SIGCHLD) as u64;
        let spawn = (libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD) as u64;
        for flags in [thread, fork, spawn] {
            assert_eq!(call("clone", flags, 0), Verdict::Allow, "clone({flags:#x})");
        }
        assert_eq!(call("clone3", 0, 88), Verdict::Errno(libc::ENOSYS));
        // Sessions with a terminal, and its sockets.
        for request in [
            libc::TIOCSCTTY,
            libc::TIOCSWINSZ,
            libc::TIOCGPTN,
            libc::TIOCSPTLCK,
            libc::TIOCGPTPEER,
            libc::FIONBIO,
        ] {
            assert_eq!(call("ioctl", 5, request), Verdict::Allow, "ioctl {request:#x}");
        }
        for family in [libc::AF_UNIX, libc::AF_INET, libc::AF_INET6] {
            assert_eq!(call("socket", family as u64, libc::SOCK_STREAM as u64), Verdict::Allow);
        }
        assert_eq!(
            call("socketpair", libc::AF_UNIX as u64, libc::SOCK_STREAM as u64),
            Verdict::Allow
        );
    }

    #[test]
    fn ioctl_refuses_exactly_the_denied_requests_compared_on_their_low_32_bits() {
        let p = profile().unwrap();
        let rules: Vec<&LinuxSyscall> = p
            .syscalls()
            .iter()
            .flatten()
            .filter(|r| r.names().iter().any(|n| n == "ioctl"))
            .collect();
        assert!(!rules.is_empty());
        for rule in &rules {
            let args = rule.args().as_ref().expect("ioctl is allowed only with a condition");
            assert_eq!(args.len(), 1);
            let arg = &args[0];
            assert_eq!(
                (arg.index(), arg.op()),
                (1, LinuxSeccompOperator::ScmpCmpMaskedEq),
                "{rule:?}"
            );
            assert_eq!(arg.value() & !LOW_32, 0, "a mask beyond the low 32 bits: {rule:?}");
        }
        let denied: HashSet<u32> = DENIED_IOCTLS.iter().map(|&(_, r)| r).collect();
        for &(name, request) in DENIED_IOCTLS {
            for high in [0u64, 1 << 32, 0xffff_ffff_0000_0000, 0x8000_0000_0000_0000] {
                assert_eq!(call("ioctl", 0, high | request as u64), EPERM, "{name} | {high:#x}");
            }
            // Every request one bit away is allowed (unless denied itself).
            for bit in 0..32 {
                let near = request ^ (1 << bit);
                let want = if denied.contains(&near) { EPERM } else { Verdict::Allow };
                assert_eq!(call("ioctl", 0, near as u64), want, "{near:#x}");
            }
        }
        for x in values(200_000) {
            let want = if denied.contains(&(x as u32)) {
                EPERM
            } else {
                Verdict::Allow
            };
            assert_eq!(verdict(&p, "ioctl", [3, x, 0, 0, 0, 0]), want, "{x:#x}");
        }
        // Requests programs make, also sign-extended from an int (as musl passes them).
        for request in [
            libc::TCGETS,
            libc::TCSETS,
            libc::TCSETSW,
            libc::TIOCGWINSZ,
            libc::TIOCSWINSZ,
            libc::TIOCGPGRP,
            libc::TIOCSPGRP,
            libc::TIOCNOTTY,
            libc::TIOCGPTN,
            libc::FIONREAD,
            libc::FIOCLEX,
            libc::FICLONE,
            libc::FICLONERANGE,
        ] {
            let request = request as u32;
            for arg in [request as u64, request as i32 as i64 as u64] {
                assert_eq!(call("ioctl", 1, arg), Verdict::Allow, "{arg:#x}");
            }
        }
    }

    #[test]
    fn the_complement_cover_matches_every_value_but_the_given_ones() {
        for (i, set) in [
            vec![],
            vec![0],
            vec![u32::MAX],
            vec![0x5412, 0x5413],
            vec![1, 2, 4, 0x8000_0000],
        ]
        .into_iter()
        .chain(values(20).map(|x| vec![x as u32, (x >> 32) as u32, (x >> 16) as u32]))
        .enumerate()
        {
            let cover = complement_cover(&set);
            assert!(
                cover.len() <= 32 * set.len().max(1),
                "set {i}: {} conditions",
                cover.len()
            );
            let covered = |x: u32| cover.iter().any(|&(m, v)| x & m == v);
            for &d in &set {
                assert!(!covered(d), "set {i}: {d:#x} is matched");
                for bit in 0..32 {
                    let near = d ^ (1 << bit);
                    assert_eq!(covered(near), !set.contains(&near), "set {i}: {near:#x}");
                }
            }
            for x in values(5_000) {
                assert_eq!(covered(x as u32), !set.contains(&(x as u32)), "set {i}: {x:#x}");
            }
        }
    }

    #[test]
    fn clone_and_unshare_may_not_make_namespaces_and_clone3_is_enosys() {
        for name in ["clone", "unshare"] {
            let mut flag = 1u64;
            while flag < 1 << 32 {
                let want = if flag & NAMESPACE_FLAGS != 0 {
                    EPERM
                } else {
                    Verdict::Allow
                };
                for other in [
                    0,
                    libc::SIGCHLD as u64 | libc::CLONE_FILES as u64,
                    0xffff_ffff_0000_0000,
                ] {
                    assert_eq!(call(name, flag | other, 0), want, "{name}({:#x})", flag | other);
                }
                flag <<= 1;
            }
            assert_eq!(call(name, libc::CLONE_NEWUSER as u64, 0), EPERM);
        }
        assert_eq!(call("clone3", 0, 0), Verdict::Errno(libc::ENOSYS));
    }

    #[test]
    fn personality_allows_only_the_values_docker_allows() {
        for &value in PERSONALITIES {
            assert_eq!(call("personality", value as u64, 0), Verdict::Allow, "{value:#x}");
            assert_eq!(
                call("personality", 0xdead_0000_0000_0000 | value as u64, 0),
                Verdict::Allow
            );
        }
        assert_eq!(
            call("personality", u64::MAX, 0),
            Verdict::Allow,
            "the query, sign-extended"
        );
        // READ_IMPLIES_EXEC, ADDR_NO_RANDOMIZE, MMAP_PAGE_ZERO, ADDR_COMPAT_LAYOUT.
        for value in [0x0400000u64, 0x0040000, 0x0100000, 0x0200000, 0x0040008] {
            assert_eq!(call("personality", value, 0), EPERM, "{value:#x}");
        }
    }

    #[test]
    fn sockets_only_of_the_usual_families() {
        for &family in SOCKET_FAMILIES {
            assert_eq!(call("socket", family as u64, 1), Verdict::Allow);
            assert_eq!(call("socket", 1 << 40 | family as u64, 1), Verdict::Allow);
        }
        // AF_PACKET, AF_ALG, AF_VSOCK, AF_BLUETOOTH, AF_TIPC, AF_RDS, AF_CAN, AF_XDP, AF_KEY.
        for family in [17u64, 38, 40, 31, 30, 21, 29, 44, 15] {
            assert_eq!(call("socket", family, 1), EPERM, "family {family}");
            assert_eq!(call("socket", 1 << 32 | family, 1), EPERM, "family {family}");
        }
        assert_eq!(call("socketpair", libc::AF_UNIX as u64, 1), Verdict::Allow);
        assert_eq!(call("socketpair", libc::AF_INET as u64, 1), EPERM);
        assert_eq!(call("socketpair", 30, 1), EPERM);
    }
}
