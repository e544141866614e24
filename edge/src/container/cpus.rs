//! The CPUs a sandbox may run on: a cpuset of `ceil(cpu_millis / 1000)` of the host's
//! CPUs, as a VM of that size would have vCPUs.
//!
//! The CFS quota (`cpu_millis`) bounds how much CPU time a sandbox gets; it does not
//! say how many CPUs it sees. lxcfs (see [`super::lxcfs`]) makes the files agree with
//! the quota, but `nproc` (coreutils and busybox), OpenBLAS, Go's runtime, Node's
//! `availableParallelism` and Python's `os.sched_getaffinity` count the CPUs in the
//! affinity mask, which only a cpuset narrows (a mask set on PID 1 could be widened again
//! by any process inside). So each sandbox gets that many CPUs, chosen when it is made:
//! those fewest of this edge's sandboxes run on (ties: the lowest number), so sandboxes
//! spread over the host. A sandbox whose quota covers every CPU gets no cpuset.
//!
//! The cost: a sandbox cannot move to a CPU outside its set when its own are busy with
//! other sandboxes while others idle; picking the least used CPUs at creation keeps that
//! rare while the edge runs fewer busy sandboxes than CPUs, and a sandbox never gets
//! more CPU time than its quota anyway.
//!
//! The set is recorded in the sandbox's record (`cpus`), and the counts are rebuilt from
//! the records when the edge starts.

use std::sync::Mutex;

/// CPUs a sandbox of `cpu_millis` gets: the quota rounded up to whole CPUs.
pub fn count(cpu_millis: u32) -> usize {
    (cpu_millis as usize).div_ceil(1000).max(1)
}

/// The CPUs this process may run on (its affinity mask), in order.
pub fn host_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the size is that of `set`.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect();
    }
    // SAFETY: CPU_ISSET reads the set we own.
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// A cpuset list as the kernel writes it (`0-2,5`).
pub fn format(cpus: &[usize]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            sorted[i].to_string()
        } else {
            format!("{}-{}", sorted[i], sorted[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// The CPUs of a cpuset list (`0-2,5`); parts it cannot read are left out.
pub fn parse(list: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                    out.extend(a..=b);
                }
            }
            None => out.extend(part.trim().parse::<usize>().ok()),
        }
    }
    out
}

/// How many of this edge's sandboxes use each host CPU.
pub struct CpuSets {
    host: Vec<usize>,
    /// Sandboxes per CPU, in the order of `host`.
    load: Mutex<Vec<usize>>,
}

impl CpuSets {
    /// Over `host`'s CPUs, with the sets of the sandboxes that exist.
    pub fn adopt<'a>(host: Vec<usize>, sets: impl IntoIterator<Item = &'a str>) -> Self {
        let me = Self {
            load: Mutex::new(vec![0; host.len()]),
            host,
        };
        for set in sets {
            me.take(set);
        }
        me
    }

    pub fn host(&self) -> &[usize] {
        &self.host
    }

    /// The cpuset of a new sandbox of `cpu_millis`, now counted; `None` when its quota
    /// covers every CPU (no cpuset: it runs anywhere).
    pub fn allocate(&self, cpu_millis: u32) -> Option<String> {
        let n = count(cpu_millis);
        if n >= self.host.len() {
            return None;
        }
        let mut load = self.load.lock().expect("cpu sets lock");
        let mut order: Vec<usize> = (0..self.host.len()).collect();
        order.sort_by_key(|&i| (load[i], i));
        let chosen: Vec<usize> = order[..n].to_vec();
        for &i in &chosen {
            load[i] += 1;
        }
        Some(format(&chosen.iter().map(|&i| self.host[i]).collect::<Vec<_>>()))
    }

    /// Counts a set in use (a sandbox found at start).
    fn take(&self, set: &str) {
        let mut load = self.load.lock().expect("cpu sets lock");
        for cpu in parse(set) {
            if let Some(i) = self.host.iter().position(|&c| c == cpu) {
                load[i] += 1;
            }
        }
    }

    /// Gives a set back (its sandbox is gone).
    pub fn release(&self, set: &str) {
        let mut load = self.load.lock().expect("cpu sets lock");
        for cpu in parse(set) {
            if let Some(i) = self.host.iter().position(|&c| c == cpu) {
                load[i] = load[i].saturating_sub(1);
            }
        }
    }

    /// Sandboxes per host CPU (for tests and logs).
    pub fn load(&self) -> Vec<usize> {
        self.load.lock().expect("cpu sets lock").clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_are_written_and_read_as_the_kernel_does() {
        assert_eq!(format(&[5, 0, 1, 2]), "0-2,5");
        assert_eq!(format(&[3]), "3");
        assert_eq!(parse("0-2,5\n"), vec![0, 1, 2, 5]);
        assert_eq!(parse(""), Vec::<usize>::new());
        assert_eq!(count(1), 1);
        assert_eq!(count(1000), 1);
        assert_eq!(count(1001), 2);
        assert_eq!(count(2000), 2);
    }

    #[test]
    fn sandboxes_spread_over_the_least_used_cpus_and_a_whole_host_quota_gets_no_cpuset() {
        let sets = CpuSets::adopt(vec![0, 1, 2, 3], ["1"]);
        assert_eq!(sets.allocate(1000).as_deref(), Some("0"));
        assert_eq!(sets.allocate(2000).as_deref(), Some("2-3"));
        assert_eq!(sets.load(), vec![1, 1, 1, 1]);
        assert_eq!(sets.allocate(500).as_deref(), Some("0"));
        assert_eq!(sets.allocate(4000), None, "every CPU: no cpuset");
        sets.release("2-3");
        assert_eq!(sets.allocate(1500).as_deref(), Some("2-3"));
        sets.release("7");
        assert_eq!(sets.load(), vec![2, 1, 1, 1]);
    }
}
