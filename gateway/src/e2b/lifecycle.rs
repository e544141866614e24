//! E2B's sandbox writes: create (and what a template name means), connect and resume,
//! kill, timeout, refresh, pause, fork and network. Each is an OpenDsec command submitted
//! with the caller's own token.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use opendsec_commands::{Command, SandboxOptions};
use opendsec_projections::{Desired, Isolation, Observed, Right};
use serde_json::{Map, Value, json};

use super::api::*;
use super::body::{body_object, opt_bool, opt_str, opt_u64, string_map, unsupported};
use crate::AppState;

pub(super) async fn create(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> R<Response> {
    let who = caller(&st, &headers).await?;
    let m = body_object(&body)?;
    let template = opt_str(&m, "templateID")?
        .filter(|t| !t.is_empty())
        .ok_or_else(|| E2bError::bad("templateID is required"))?;
    let timeout = opt_u64(&m, "timeout")?.unwrap_or(DEFAULT_TIMEOUT_SECONDS);
    let auto_pause = opt_bool(&m, "autoPause")?.unwrap_or(false);
    // The next call to a paused sandbox resumes it unless the create says otherwise.
    let auto_resume = match m.get("autoResume") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(Value::Object(o)) => match o.get("enabled") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(E2bError::bad("autoResume.enabled must be a boolean")),
        },
        Some(_) => return Err(E2bError::bad("autoResume must be an object {\"enabled\": bool}")),
    };
    // E2B's `allow_internet_access` (older SDKs, 2.50, send true on every create) and
    // `network` over the project's default policy; neither: the default itself.
    let allow_internet = opt_bool(&m, "allow_internet_access")?;
    let _ = opt_bool(&m, "secure")?; // every sandbox is secured by its access token
    // false: the auto-pause keeps only the file system (the sandbox's processes end; its
    // resume boots it again).
    let auto_pause_filesystem = auto_pause && opt_bool(&m, "autoPauseMemory")? == Some(false);
    for f in ["iam", "volumeMounts"] {
        unsupported(&m, f)?;
    }
    // The SDK itself starts the gateway (`mcp-gateway --config ...` in the `mcp-gateway`
    // template, or in the caller's own); the create only checks the shape it sends.
    mcp_servers(&m)?;
    let network = match m.get("network") {
        None | Some(Value::Null) => None,
        Some(Value::Object(n)) => Some(n),
        Some(_) => return Err(E2bError::bad("network must be an object")),
    };
    let network = (allow_internet.is_some() || network.is_some()).then(|| {
        let default = st.node.read(|s| s.default_network(&who.project).map(str::to_string));
        crate::convert::e2b_network(default.as_deref(), allow_internet, network, None)
    });
    let metadata = string_map(&m, "metadata")?;
    let env = string_map(&m, "envVars")?;
    require(&who, Right::SandboxWrite)?;
    let (image, isolation) = template_image(template);
    let idempotency_key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .map(str::to_string);
    // A create repeated with its idempotency key (a retry after a lost answer) is the
    // sandbox the first one made.
    if let Some(key) = &idempotency_key {
        let existing = st
            .node
            .read(|s| s.sandboxes.by_idempotency_key(&who.project, key).map(|x| x.id.clone()));
        if let Some(id) = existing {
            let x = wait_ready(&st, &id).await?;
            return Ok(created(sandbox_json(&st, &x)));
        }
    }
    // A template built with a size gives its sandboxes that size.
    let (cpu_count, memory_mb) = st.node.read(|s| {
        let name = image.split_once(':').map_or(image.as_str(), |(n, _)| n);
        s.images
            .template_named(name)
            .filter(|t| s.within(&who.project, &t.project))
            .map_or((0, 0), |t| (t.cpu_count, t.memory_mb))
    });
    let cmd = Command::CreateSandbox {
        project: who.project.clone(),
        image,
        cpu_millis: match cpu_count {
            0 => crate::routes::sandboxes::DEFAULT_CPU_MILLIS,
            n => n as u64 * 1000,
        },
        memory_mb: match memory_mb {
            0 => crate::routes::sandboxes::DEFAULT_MEMORY_MB,
            n => n as u64,
        },
        labels: metadata,
        timeout_seconds: (timeout > 0).then_some(timeout),
        opts: SandboxOptions {
            env,
            auto_pause,
            auto_pause_filesystem,
            auto_resume,
            network,
            idempotency_key: idempotency_key.clone(),
            isolation,
            cpu_class: None,
        },
    };
    let s = match submit(&st, &who, &headers, cmd).await {
        Ok(s) => s.decided.target,
        // Two creates with one key raced: the other one's sandbox is the answer.
        Err(e) if e.status == StatusCode::CONFLICT && idempotency_key.is_some() => {
            let key = idempotency_key.as_deref().unwrap_or_default();
            st.node
                .read(|s| s.sandboxes.by_idempotency_key(&who.project, key).map(|x| x.id.clone()))
                .ok_or(e)?
        }
        Err(e) => return Err(e),
    };
    let x = wait_ready(&st, &s).await?;
    let enforced = st.node.read(|s| crate::convert::egress_enforced(s, &x.edge));
    let warning = crate::convert::egress_warning(&crate::convert::network(x.network.as_deref()), enforced);
    Ok((warning, created(sandbox_json(&st, &x))).into_response())
}

/// The suffix of a template name that asks for a microVM of the image: `base-vm` is the
/// `base` image in a QEMU microVM, whose pause, snapshots and forks carry its memory.
pub const MICROVM_TEMPLATE_SUFFIX: &str = "-vm";

/// The suffix of a template name that asks for a full VM of the image: `base-fullvm` is
/// the `base` image booted as a whole disk in a QEMU q35 PC (memory carried as a microVM's).
pub const FULLVM_TEMPLATE_SUFFIX: &str = "-fullvm";

/// `mcp`: absent, or an object of servers, each with an object of settings (what the
/// servers accept is the gateway's to say, inside the sandbox).
fn mcp_servers(m: &Map<String, Value>) -> R<()> {
    match m.get("mcp") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Object(servers)) => match servers.iter().find(|(_, v)| !v.is_object()) {
            Some((name, _)) => Err(E2bError::bad(format!("mcp.{name} must be an object of settings"))),
            None => Ok(()),
        },
        Some(_) => Err(E2bError::bad("mcp must be an object naming MCP servers")),
    }
}

/// The image a template name means, and the isolation it asks for (none: a container,
/// or whatever a snapshot id is a snapshot of). A tag (`base-vm:latest`) stays on the image.
pub fn template_image(template: &str) -> (String, Option<Isolation>) {
    let (name, tag) = match template.split_once(':') {
        Some((n, t)) => (n, Some(t)),
        None => (template, None),
    };
    let asked = [
        (FULLVM_TEMPLATE_SUFFIX, Isolation::Vm),
        (MICROVM_TEMPLATE_SUFFIX, Isolation::Microvm),
    ]
    .into_iter()
    .find_map(|(suffix, isolation)| {
        name.strip_suffix(suffix)
            .filter(|n| !n.is_empty())
            .map(|image| (image, isolation))
    });
    match asked {
        Some((image, isolation)) => (
            tag.map_or_else(|| image.to_string(), |t| format!("{image}:{t}")),
            Some(isolation),
        ),
        None => (template.to_string(), None),
    }
}

pub(super) async fn connect(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> R<Response> {
    let who = caller(&st, &headers).await?;
    let m = body_object(&body)?;
    let timeout = opt_u64(&m, "timeout")?;
    // false: a paused sandbox boots again from its file system, whatever its pause kept.
    let cold = opt_bool(&m, "memory")? == Some(false);
    let x = visible(&st, &who, &id)?;
    let resumed = x.desired == Desired::Paused || x.observed == Observed::Paused;
    if resumed {
        pause_settled(&st, &id).await?;
        let cmd = Command::ResumeSandbox {
            sandbox: id.clone(),
            cold,
        };
        submit(&st, &who, &headers, cmd).await?;
    }
    // A connect only extends the lifetime (E2B's rule): a running sandbox whose end is
    // later than `timeout` from now keeps it. A resumed one gets the timeout it asks
    // for, and one whose timeout was spent pausing it runs on with a default lifetime.
    let wanted_end = |t: u64| opendsec_control::now_ms() + t * 1000;
    let lifetime = timeout
        .filter(|t| *t > 0)
        .filter(|t| resumed || x.expires_at_ms.is_some_and(|e| e < wanted_end(*t)))
        .or_else(|| (resumed && x.expires_at_ms.is_none() && x.auto_pause).then_some(DEFAULT_TIMEOUT_SECONDS));
    if let Some(t) = lifetime {
        submit(
            &st,
            &who,
            &headers,
            Command::SetSandboxTimeout {
                sandbox: id.clone(),
                timeout_seconds: t,
            },
        )
        .await?;
    }
    let x = wait_ready(&st, &id).await?;
    let status = if resumed { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(sandbox_json(&st, &x))).into_response())
}

pub(super) async fn kill(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> R<Response> {
    let who = caller(&st, &headers).await?;
    visible(&st, &who, &id)?;
    submit(&st, &who, &headers, Command::KillSandbox { sandbox: id }).await?;
    Ok(no_content())
}

pub(super) async fn set_timeout(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> R<Response> {
    let who = caller(&st, &headers).await?;
    let m = body_object(&body)?;
    let t = opt_u64(&m, "timeout")?.ok_or_else(|| E2bError::bad("timeout is required (seconds from now)"))?;
    visible(&st, &who, &id)?;
    submit(
        &st,
        &who,
        &headers,
        Command::SetSandboxTimeout {
            sandbox: id,
            timeout_seconds: t,
        },
    )
    .await?;
    Ok(no_content())
}

/// Extends the lifetime to at least `duration` seconds from now (never shortens it).
pub(super) async fn refresh(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> R<Response> {
    let who = caller(&st, &headers).await?;
    let m = body_object(&body)?;
    let d = opt_u64(&m, "duration")?.unwrap_or(60);
    let x = visible(&st, &who, &id)?;
    let wanted = opendsec_control::now_ms() + d * 1000;
    if x.expires_at_ms.is_some_and(|e| e < wanted) {
        submit(
            &st,
            &who,
            &headers,
            Command::SetSandboxTimeout {
                sandbox: id,
                timeout_seconds: d,
            },
        )
        .await?;
    }
    Ok(no_content())
}

pub(super) async fn pause(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> R<Response> {
    let who = caller(&st, &headers).await?;
    let m = body_object(&body)?;
    // `memory: false` (the SDK's `mode="filesystem"`, or `keep_memory=False`): only the
    // file system is kept. `requireHealthyGuest`: a sandbox that is not answering would
    // not be paused; every sandbox paused here is one its edge reports running.
    let filesystem = opt_bool(&m, "memory")? == Some(false);
    let _ = opt_bool(&m, "requireHealthyGuest")?;
    let x = visible(&st, &who, &id)?;
    if x.desired == Desired::Paused {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        ));
    }
    let cmd = Command::PauseSandbox {
        sandbox: id.clone(),
        filesystem,
    };
    submit(&st, &who, &headers, cmd).await?;
    wait_for(&st, &id, ACTION_WAIT, |x| {
        ended(x).or_else(|| (x.observed == Observed::Paused).then_some(Ok(())))
    })
    .await?;
    Ok(no_content())
}

/// `count` copies of the sandbox as it is now: a container's with its file system, a
/// microVM's (`-vm` templates) with its memory and disk.
pub(super) async fn fork(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> R<Response> {
    let who = caller(&st, &headers).await?;
    let m = body_object(&body)?;
    let count = opt_u64(&m, "count")?.unwrap_or(1);
    let timeout = opt_u64(&m, "timeout")?;
    if count == 0 || count > opendsec_commands::LIMITS.fork_count as u64 {
        return Err(E2bError::bad(format!(
            "count must be 1 to {}",
            opendsec_commands::LIMITS.fork_count
        )));
    }
    visible(&st, &who, &id)?;
    let s = submit(
        &st,
        &who,
        &headers,
        Command::ForkSandbox {
            sandbox: id,
            count: count as u32,
            edge: None,
        },
    )
    .await?;
    let children = s.decided.created_sandboxes();
    let mut out = Vec::new();
    for c in children {
        let r = async {
            if let Some(t) = timeout.filter(|t| *t > 0) {
                submit(
                    &st,
                    &who,
                    &headers,
                    Command::SetSandboxTimeout {
                        sandbox: c.clone(),
                        timeout_seconds: t,
                    },
                )
                .await?;
            }
            wait_ready(&st, &c).await
        }
        .await;
        out.push(match r {
            Ok(x) => json!({ "sandbox": sandbox_json(&st, &x) }),
            Err(e) => json!({ "error": { "code": e.status.as_u16(), "message": e.message } }),
        });
    }
    Ok(created(Value::Array(out)))
}

pub(super) async fn network(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> R<Response> {
    let who = caller(&st, &headers).await?;
    let m = body_object(&body)?;
    visible(&st, &who, &id)?;
    // An update names the rules anew; internet access and the settings of traffic into
    // the sandbox stay as they were unless it says otherwise.
    let (current, enforced) = st.node.read(|s| {
        let x = s.sandboxes.sandboxes.get(&id);
        let enforced = x.is_some_and(|x| crate::convert::egress_enforced(s, &x.edge));
        (x.and_then(|x| x.network.clone()), enforced)
    });
    let internet = opendsec_commands::network::Policy::of_logged(current.as_deref()).allow_internet;
    let base = serde_json::json!({ "allow_internet_access": internet }).to_string();
    let network = crate::convert::e2b_network(Some(&base), None, Some(&m), current.as_deref());
    let warning = crate::convert::egress_warning(&crate::convert::network(Some(&network)), enforced);
    submit(&st, &who, &headers, Command::SetSandboxNetwork { sandbox: id, network }).await?;
    Ok((warning, no_content()).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_suffix_asks_for_a_microvm_of_the_image() {
        assert_eq!(
            template_image("base-vm"),
            ("base".to_string(), Some(Isolation::Microvm))
        );
        assert_eq!(
            template_image("code-interpreter-v1-vm:latest"),
            ("code-interpreter-v1:latest".to_string(), Some(Isolation::Microvm))
        );
        assert_eq!(template_image("base-fullvm"), ("base".to_string(), Some(Isolation::Vm)));
        assert_eq!(
            template_image("base-fullvm:latest"),
            ("base:latest".to_string(), Some(Isolation::Vm))
        );
        assert_eq!(template_image("-fullvm"), ("-fullvm".to_string(), None));
        assert_eq!(template_image("base"), ("base".to_string(), None));
        assert_eq!(
            template_image("snap-0123456789abcdef"),
            ("snap-0123456789abcdef".to_string(), None)
        );
        assert_eq!(
            template_image("-vm"),
            ("-vm".to_string(), None),
            "a suffix alone names no image"
        );
    }
}
