//! Which program the kernel's OOM killer ended in each memory cgroup. A sandbox whose
//! process was OOM-killed lives on (as a VM does); its memory cgroup counts the kills and
//! the kernel log says whom: one `oom-kill:` record per kill, naming the cgroup whose
//! limit was hit (`oom_memcg=`) and the victim's program (`task=`). A thread follows
//! `/dev/kmsg` from the edge's start and keeps the last victim per cgroup. Where the log
//! cannot be read (no `/dev/kmsg`, no CAP_SYSLOG), kills are still counted, without names.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The last OOM victim's program per memory cgroup, as the kernel log names them.
#[derive(Default)]
pub struct OomLog {
    last: Mutex<HashMap<String, String>>,
}

impl OomLog {
    /// Follows the kernel log on a thread of its own; an edge that cannot read it says
    /// so once and gets an empty log.
    pub fn follow() -> Arc<OomLog> {
        let log = Arc::new(OomLog::default());
        let take = |log: &OomLog, record: &str| {
            if let Some((memcg, task)) = parse_record(record) {
                log.record(memcg, task);
            }
        };
        if let Err(e) = crate::kmsg::follow("oom-log", &log, take) {
            tracing::warn!(
                error = %e,
                "cannot follow /dev/kmsg: OOM kills inside sandboxes are counted but their programs are not named"
            );
        }
        log
    }

    /// The program last OOM-killed in memory cgroup `cgroups_path`, if the log named one.
    pub fn last_victim(&self, cgroups_path: &str) -> Option<String> {
        self.last.lock().expect("oom log lock").get(cgroups_path).cloned()
    }

    /// Drops what is known of cgroups no longer in `live`.
    pub fn retain(&self, live: impl Fn(&str) -> bool) {
        self.last.lock().expect("oom log lock").retain(|k, _| live(k));
    }

    fn record(&self, memcg: String, task: String) {
        self.last.lock().expect("oom log lock").insert(memcg, task);
    }
}

/// `(oom_memcg, task)` of an `oom-kill:` record (`<prefix>;oom-kill:...,oom_memcg=/a/b,
/// task_memcg=...,task=python3,pid=12,uid=0`).
pub fn parse_record(record: &str) -> Option<(String, String)> {
    let msg = record.split_once(';')?.1.lines().next()?;
    let fields = msg.strip_prefix("oom-kill:")?;
    let memcg = fields.split(',').find_map(|f| f.strip_prefix("oom_memcg="))?;
    // A program's name may hold a comma: it runs up to the `,pid=` that follows it.
    let after = &fields[fields.find(",task=")? + ",task=".len()..];
    let task = &after[..after.rfind(",pid=")?];
    Some((memcg.to_string(), task.to_string()))
}

#[cfg(test)]
mod tests {
    use super::parse_record;

    #[test]
    fn a_memcg_oom_kill_record_names_the_cgroup_and_the_program() {
        let r = "6,3301,9550661578,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,\
                 mems_allowed=0,oom_memcg=/opendsec/sb-1,task_memcg=/opendsec/sb-1,task=python3,pid=22307,uid=0\n";
        assert_eq!(
            parse_record(r),
            Some(("/opendsec/sb-1".to_string(), "python3".to_string()))
        );
    }

    #[test]
    fn a_program_name_with_a_comma_is_kept_whole() {
        let r = "6,1,1,-;oom-kill:constraint=CONSTRAINT_MEMCG,oom_memcg=/x,task_memcg=/x,task=a,b,pid=1,uid=0";
        assert_eq!(parse_record(r), Some(("/x".to_string(), "a,b".to_string())));
    }

    #[test]
    fn other_records_are_not_oom_kills() {
        assert_eq!(
            parse_record("6,1,1,-;Memory cgroup out of memory: Killed process 1 (x)"),
            None
        );
        assert_eq!(parse_record("no separator"), None);
    }
}
