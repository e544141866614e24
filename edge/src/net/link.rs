//! A sandbox's link to the edge: a named network namespace (`/run/netns/<name>`, as
//! `ip netns` makes them, owned by host root: root in the sandbox's user namespace has
//! no capability over it, so it cannot change its addresses or routes) holding `lo` and
//! `eth0`, the sandbox end of a veth pair whose host end carries the edge's gateway
//! address. `eth0` has the sandbox's /32 (and /128) and a default route on-link via the
//! gateway (IPv6: via `fe80::1`, which the host end also carries); the host routes the
//! sandbox's addresses to its veth. Everything goes over rtnetlink, from the module's one
//! worker thread, which enters the namespace a job changes and comes back (a netlink
//! socket keeps the namespace it was opened in).

use super::NetError;
use futures::TryStreamExt;
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags};
use rtnetlink::packet_route::link::{InfoData, InfoVeth, LinkAttribute, Stats64};
use rtnetlink::packet_route::route::RouteScope;
use rtnetlink::{Handle, LinkUnspec, LinkVeth, RouteMessageBuilder};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Where named network namespaces are bound (as `ip netns` does).
pub const NETNS_DIR: &str = "/run/netns";
/// The sandbox's interface.
pub const SANDBOX_IF: &str = "eth0";
/// The IPv6 gateway every host end carries (link-local: the same on every veth).
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);

/// One sandbox's link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkPlan {
    /// The namespace's name under [`NETNS_DIR`].
    pub netns: String,
    /// The host end's name (at most 15 bytes).
    pub veth: String,
    pub gateway: Ipv4Addr,
    pub v4: Ipv4Addr,
    pub v6: Option<Ipv6Addr>,
}

/// The path of namespace `name`.
pub fn netns_path(name: &str) -> PathBuf {
    Path::new(NETNS_DIR).join(name)
}

fn link_err(what: &str) -> impl FnOnce(rtnetlink::Error) -> NetError + '_ {
    move |e| NetError::Link(format!("{what}: {e}"))
}

/// One thread runs every namespace job of this module in turn: it enters the namespace
/// a job names, runs it, and comes back to its own. A thread per job would cost each
/// its own allocator arena (tens of MiB of RSS in a burst of creates) and a runtime.
struct Worker {
    jobs: std::sync::Mutex<std::sync::mpsc::Sender<Box<dyn FnOnce() + Send>>>,
}

fn worker() -> &'static Worker {
    static WORKER: std::sync::OnceLock<Worker> = std::sync::OnceLock::new();
    WORKER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
        std::thread::Builder::new()
            .name("netns-worker".into())
            .spawn(move || {
                // Where it comes back to after each job.
                let home = std::fs::File::open("/proc/thread-self/ns/net").expect("the worker's own namespace");
                for job in rx {
                    job();
                    // SAFETY: setns on an fd we own, for this thread only.
                    if unsafe { libc::setns(home.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        // A worker stuck elsewhere must not run the next job there.
                        panic!("the netns worker cannot return to its namespace");
                    }
                }
            })
            .expect("starting the netns worker");
        Worker {
            jobs: std::sync::Mutex::new(tx),
        }
    })
}

/// Runs `f` on the worker, inside namespace `netns` when given (`None`: the edge's),
/// and returns what it returns.
pub(super) fn on_worker<T: Send + 'static>(
    netns: Option<&Path>,
    f: impl FnOnce() -> Result<T, NetError> + Send + 'static,
) -> Result<T, NetError> {
    let ns = netns
        .map(|p| std::fs::File::open(p).map_err(|e| NetError::io(format!("opening {}", p.display()), e)))
        .transpose()?;
    let (tx, rx) = std::sync::mpsc::channel();
    let job = Box::new(move || {
        let r = match &ns {
            // SAFETY: setns on an fd we own; it changes only the worker's namespace.
            Some(ns) if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 => Err(NetError::io(
                "entering a sandbox's network namespace",
                std::io::Error::last_os_error(),
            )),
            // A job that panics fails alone; the worker goes on with the next.
            _ => std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
                .unwrap_or_else(|_| Err(NetError::Link("a netns job panicked".into()))),
        };
        let _ = tx.send(r);
    });
    worker()
        .jobs
        .lock()
        .expect("netns worker lock")
        .send(job)
        .map_err(|_| NetError::Link("the netns worker is gone".into()))?;
    rx.recv()
        .unwrap_or_else(|_| Err(NetError::Link("the netns worker dropped a job".into())))
}

/// Runs `f` over an rtnetlink connection opened in namespace `netns` (`None`: the
/// caller's), on a thread of its own with a runtime of its own, so any thread may call
/// it (a blocking one of the edge's runtime, or a test's).
fn netlink<T, F, Fut>(netns: Option<&Path>, f: F) -> Result<T, NetError>
where
    T: Send + 'static,
    F: FnOnce(Handle) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<T, NetError>>,
{
    on_worker(netns, move || {
        thread_local! {
            static RT: Option<tokio::runtime::Runtime> =
                tokio::runtime::Builder::new_current_thread().enable_io().build().ok();
        }
        RT.with(|rt| {
            let rt = rt
                .as_ref()
                .ok_or_else(|| NetError::Link("the netlink runtime cannot start".into()))?;
            rt.block_on(async move {
                // Opened here, in the namespace the worker is in now, and kept there.
                let (conn, handle, _) =
                    rtnetlink::new_connection().map_err(|e| NetError::io("opening a netlink socket", e))?;
                let conn = tokio::spawn(conn);
                let r = f(handle).await;
                conn.abort();
                r
            })
        })
    })
}

/// The index of link `name`, if it exists.
async fn index_of(h: &Handle, name: &str) -> Result<Option<u32>, NetError> {
    let mut links = h.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(m)) => Ok(Some(m.header.index)),
        Ok(None) => Ok(None),
        // ENODEV: no such link.
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => Ok(None),
        Err(e) => Err(NetError::Link(format!("looking up link {name}: {e}"))),
    }
}

async fn add_addr(h: &Handle, index: u32, ip: IpAddr, prefix: u8, nodad: bool) -> Result<(), NetError> {
    let mut req = h.address().add(index, ip, prefix).replace();
    if nodad {
        req.message_mut()
            .attributes
            .push(AddressAttribute::Flags(AddressFlags::Nodad));
    }
    req.execute().await.map_err(link_err("adding an address"))
}

async fn up(h: &Handle, index: u32) -> Result<(), NetError> {
    h.link()
        .set(LinkUnspec::new_with_index(index).up().build())
        .execute()
        .await
        .map_err(link_err("setting a link up"))
}

/// Makes `/run/netns` a shared mount point, as `ip netns` does, so a namespace bound
/// there and later deleted is released in every mount namespace that copied it.
fn shared_netns_dir() -> Result<(), NetError> {
    use nix::mount::{MsFlags, mount};
    let dir = Path::new(NETNS_DIR);
    std::fs::create_dir_all(dir).map_err(|e| NetError::io(format!("creating {NETNS_DIR}"), e))?;
    let shared = || {
        mount(
            None::<&str>,
            dir,
            None::<&str>,
            MsFlags::MS_SHARED | MsFlags::MS_REC,
            None::<&str>,
        )
    };
    if shared().is_ok() && crate::container::is_mounted(dir) {
        return Ok(());
    }
    mount(
        Some(dir),
        dir,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| NetError::io(format!("binding {NETNS_DIR}"), e.into()))?;
    shared().map_err(|e| NetError::io(format!("making {NETNS_DIR} shared"), e.into()))
}

/// Makes namespace `name`: a thread unshares a new one and binds it at its path.
fn make_netns(name: &str) -> Result<PathBuf, NetError> {
    shared_netns_dir()?;
    let path = netns_path(name);
    let target = path.clone();
    on_worker(None, move || {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&target)
            .map_err(|e| NetError::io(format!("creating {}", target.display()), e))?;
        // The worker goes back to its own namespace after the job.
        let bound = (|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| NetError::io("unsharing a network namespace", e.into()))?;
            nix::mount::mount(
                Some("/proc/thread-self/ns/net"),
                &target,
                None::<&str>,
                nix::mount::MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(|e| NetError::io(format!("binding {}", target.display()), e.into()))
        })();
        if bound.is_err() {
            let _ = std::fs::remove_file(&target);
        }
        bound
    })?;
    Ok(path)
}

/// Mounts a sysfs of namespace `netns` at `target` (read-only, made if missing): a
/// sysfs shows the network devices of the namespace its mounter is in. A container in a
/// user namespace of its own cannot mount one for a namespace host root owns (the runtime
/// would bind the host's /sys instead, which lists the host's interfaces), so the edge
/// mounts it and the container gets it bound at /sys.
pub fn mount_sysfs(netns: &Path, target: &Path) -> Result<(), NetError> {
    use nix::mount::{MsFlags, mount};
    std::fs::create_dir_all(target).map_err(|e| NetError::io(format!("creating {}", target.display()), e))?;
    if crate::container::is_mounted(target) {
        return Ok(());
    }
    let target = target.to_path_buf();
    on_worker(Some(netns), move || {
        mount(
            Some("sysfs"),
            &target,
            Some("sysfs"),
            MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            None::<&str>,
        )
        .map_err(|e| NetError::io(format!("mounting a sysfs at {}", target.display()), e.into()))
    })
}

/// Unmounts and removes what [`mount_sysfs`] made (absent: nothing).
pub fn unmount_sysfs(target: &Path) {
    let _ = nix::mount::umount2(target, nix::mount::MntFlags::MNT_DETACH);
    let _ = std::fs::remove_dir(target);
}

/// Unbinds and removes namespace `name` (the kernel frees it once no process is in it).
fn remove_netns(name: &str) -> Result<(), NetError> {
    let path = netns_path(name);
    if !path.exists() {
        return Ok(());
    }
    let _ = nix::mount::umount2(&path, nix::mount::MntFlags::MNT_DETACH);
    std::fs::remove_file(&path).map_err(|e| NetError::io(format!("removing {}", path.display()), e))
}

/// Makes `plan`'s namespace and veth, addressed and routed. Whatever an earlier,
/// unfinished attempt left of them is removed first; on error nothing is left.
pub fn create(plan: &LinkPlan) -> Result<PathBuf, NetError> {
    delete(&plan.netns, &plan.veth)?;
    let path = make_netns(&plan.netns)?;
    let made = configure(plan, &path);
    if made.is_err() {
        let _ = delete(&plan.netns, &plan.veth);
    }
    made.map(|()| path)
}

/// Makes `plan`'s veth with its sandbox end in the existing namespace at `netns` (a
/// VM's, which its QEMU runs in), addressed and routed there as in a namespace of its
/// own (`plan.netns` is not used). On error no veth is left.
pub fn join(plan: &LinkPlan, netns: &Path) -> Result<(), NetError> {
    delete_veth(&plan.veth)?;
    let made = configure(plan, netns);
    if made.is_err() {
        let _ = delete_veth(&plan.veth);
    }
    made
}

/// Sets `path` (a `/proc/sys/net` file) to `value` inside namespace `netns`: such files
/// belong to the namespace of whoever opens them.
pub fn sysctl_in(netns: &Path, path: &'static str, value: &'static str) -> Result<(), NetError> {
    on_worker(Some(netns), move || {
        std::fs::write(path, value).map_err(|e| NetError::io(format!("writing {path}"), e))
    })
}

fn configure(plan: &LinkPlan, path: &Path) -> Result<(), NetError> {
    let ns = std::fs::File::open(path).map_err(|e| NetError::io(format!("opening {}", path.display()), e))?;
    let p = plan.clone();
    netlink(None, move |h| async move {
        let peer = LinkUnspec::new_with_name(SANDBOX_IF)
            .setns_by_fd(ns.as_raw_fd())
            .build();
        h.link()
            .add(
                LinkVeth::new(&p.veth, SANDBOX_IF)
                    .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
                    .build(),
            )
            .execute()
            .await
            .map_err(|e| NetError::Link(format!("adding veth {}: {e}", p.veth)))?;
        drop(ns);
        let index = index_of(&h, &p.veth)
            .await?
            .ok_or_else(|| NetError::Link(format!("veth {} vanished after it was made", p.veth)))?;
        add_addr(&h, index, IpAddr::V4(p.gateway), 32, false).await?;
        if p.v6.is_some() {
            add_addr(&h, index, IpAddr::V6(GATEWAY_V6), 64, true).await?;
        }
        up(&h, index).await?;
        let route = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(p.v4, 32)
            .output_interface(index)
            .scope(RouteScope::Link)
            .build();
        h.route()
            .add(route)
            .replace()
            .execute()
            .await
            .map_err(link_err("routing the sandbox's IPv4 address"))?;
        if let Some(v6) = p.v6 {
            let route = RouteMessageBuilder::<Ipv6Addr>::new()
                .destination_prefix(v6, 128)
                .output_interface(index)
                .build();
            h.route()
                .add(route)
                .replace()
                .execute()
                .await
                .map_err(link_err("routing the sandbox's IPv6 address"))?;
        }
        Ok(())
    })?;
    let p = plan.clone();
    netlink(Some(path), move |h| async move {
        if let Some(lo) = index_of(&h, "lo").await? {
            up(&h, lo).await?;
        }
        let index = index_of(&h, SANDBOX_IF)
            .await?
            .ok_or_else(|| NetError::Link(format!("{SANDBOX_IF} is missing in the sandbox's namespace")))?;
        add_addr(&h, index, IpAddr::V4(p.v4), 32, false).await?;
        if let Some(v6) = p.v6 {
            add_addr(&h, index, IpAddr::V6(v6), 128, true).await?;
        }
        up(&h, index).await?;
        let route = RouteMessageBuilder::<Ipv4Addr>::new()
            .gateway(p.gateway)
            .output_interface(index)
            .onlink()
            .build();
        h.route()
            .add(route)
            .execute()
            .await
            .map_err(link_err("adding the sandbox's default route"))?;
        if p.v6.is_some() {
            let route = RouteMessageBuilder::<Ipv6Addr>::new()
                .gateway(GATEWAY_V6)
                .output_interface(index)
                .build();
            h.route()
                .add(route)
                .execute()
                .await
                .map_err(link_err("adding the sandbox's IPv6 default route"))?;
        }
        Ok(())
    })
}

/// Removes namespace `netns` and veth `veth` (either may be gone already).
pub fn delete(netns: &str, veth: &str) -> Result<(), NetError> {
    delete_veth(veth)?;
    delete_netns(netns)
}

/// Removes veth `veth` (and with it its peer), if it exists.
pub fn delete_veth(veth: &str) -> Result<(), NetError> {
    if veth.is_empty() {
        return Ok(());
    }
    let name = veth.to_string();
    netlink(None, move |h| async move {
        if let Some(index) = index_of(&h, &name).await? {
            match h.link().del(index).execute().await {
                Ok(()) => {}
                Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => {}
                Err(e) => return Err(NetError::Link(format!("deleting veth {name}: {e}"))),
            }
        }
        Ok(())
    })
}

/// Removes namespace `name` from [`NETNS_DIR`], if it is there.
pub fn delete_netns(name: &str) -> Result<(), NetError> {
    if name.is_empty() || name.contains('/') {
        return Ok(());
    }
    remove_netns(name)
}

/// Every link whose name starts with `prefix`.
pub fn links_with_prefix(prefix: &str) -> Result<Vec<String>, NetError> {
    let prefix = prefix.to_string();
    netlink(None, move |h| async move {
        let mut out = Vec::new();
        let mut links = h.link().get().execute();
        while let Some(m) = links.try_next().await.map_err(link_err("listing links"))? {
            for a in &m.attributes {
                if let LinkAttribute::IfName(n) = a
                    && n.starts_with(&prefix)
                {
                    out.push(n.clone());
                }
            }
        }
        Ok(out)
    })
}

/// Every namespace under [`NETNS_DIR`] whose name starts with `prefix`.
pub fn netns_with_prefix(prefix: &str) -> Vec<String> {
    std::fs::read_dir(NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// A veth's counters, host side: what it received the sandbox sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkCounters {
    /// From the sandbox (the host end's receive side).
    pub out_bytes: u64,
    pub out_packets: u64,
    /// To the sandbox.
    pub in_bytes: u64,
    pub in_packets: u64,
}

/// The counters of every link whose name starts with `prefix`, by name.
pub fn counters(prefix: &str) -> Result<Vec<(String, LinkCounters)>, NetError> {
    let prefix = prefix.to_string();
    netlink(None, move |h| async move {
        let mut out = Vec::new();
        let mut links = h.link().get().execute();
        while let Some(m) = links.try_next().await.map_err(link_err("listing links"))? {
            let name = m.attributes.iter().find_map(|a| match a {
                LinkAttribute::IfName(n) if n.starts_with(&prefix) => Some(n.clone()),
                _ => None,
            });
            let stats: Option<&Stats64> = m.attributes.iter().find_map(|a| match a {
                LinkAttribute::Stats64(s) => Some(s),
                _ => None,
            });
            if let (Some(name), Some(s)) = (name, stats) {
                out.push((
                    name,
                    LinkCounters {
                        out_bytes: s.rx_bytes,
                        out_packets: s.rx_packets,
                        in_bytes: s.tx_bytes,
                        in_packets: s.tx_packets,
                    },
                ));
            }
        }
        Ok(out)
    })
}
