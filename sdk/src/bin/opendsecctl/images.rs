//! `opendsecctl image`: pull (with a progress bar fed by the pulling edge's reports),
//! import (a progress bar of the upload), push, list, get, rm; and `sandbox pack`, which waits
//! the same way as a pull.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use opendsec_sdk::types::{Image, PackSandbox, PullImage, PushImage};
use opendsec_sdk::{ApiError, Client};
use std::time::{Duration, Instant};

use super::args::ImageCmd;
use super::print::{IMAGE_HEADERS, Printer, image_row, table};

pub(crate) async fn run(client: &Client, out: Printer, c: ImageCmd) -> Result<u8, ApiError> {
    match c {
        ImageCmd::Pull {
            reference,
            name,
            project,
            edge,
            no_wait,
            wait_seconds,
        } => {
            let req = PullImage {
                reference,
                name,
                project,
                edge,
            };
            let w = client.pull_image(&req).await?;
            let image = if no_wait {
                w.image
            } else {
                wait_pulled(client, w.image, Duration::from_secs(wait_seconds)).await?
            };
            out.show(&image, |x| table(&IMAGE_HEADERS, vec![image_row(x)]));
            if image.state == "failed" {
                eprintln!(
                    "hint: see the reason above; fix the reference, or the edge's registry settings \
                     (opendsec edge --insecure-registry / --registry-auth), then pull again"
                );
                return Ok(1);
            }
            if image.state == "pending" && !no_wait {
                eprintln!(
                    "the pull is still running after {wait_seconds} s; follow it with `opendsecctl image get {}`",
                    image.name
                );
                return Ok(1);
            }
        }
        ImageCmd::Import {
            file,
            name,
            project,
            edge,
        } => {
            let bar = bytes_bar(format!("importing {name}"));
            let shown = bar.clone();
            let sent = move |done: u64, total: u64| {
                shown.set_length(total);
                shown.set_position(done);
                if done == total {
                    shown.set_message("the edge verifies and unpacks it");
                }
            };
            let w = client
                .import_image(&name, &file, project.as_deref(), edge.as_deref(), sent)
                .await;
            bar.finish_and_clear();
            let w = w?;
            out.show(&w.image, |x| table(&IMAGE_HEADERS, vec![image_row(x)]));
        }
        ImageCmd::Push { name, reference } => {
            // The push answers once the manifest is written; meanwhile its progress is
            // read under an id of ours (layers written, then bytes sent).
            let id = random_id();
            let bar = bytes_bar(format!("pushing {name}"));
            bar.set_message("the edge writes the layers");
            let req = PushImage {
                image: name.clone(),
                reference,
                id: Some(id.clone()),
            };
            let push = client.push_image(&req);
            tokio::pin!(push);
            let pushed = loop {
                tokio::select! {
                    r = &mut push => break r,
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {
                        if let Ok(p) = client.push_progress(&name, &id).await {
                            bar.set_length(p.bytes_total.max(1));
                            bar.set_position(p.bytes_done);
                            bar.set_message(format!("layers {}/{}: {}", p.layers_done, p.layers_total, p.current));
                        }
                    }
                }
            };
            bar.finish_and_clear();
            let p = pushed?;
            out.show(&p, |p| {
                format!(
                    "pushed {} to {}@{} ({} layers, {:.1} MiB, from edge {})",
                    p.image,
                    p.reference,
                    p.digest,
                    p.layers,
                    p.bytes as f64 / (1 << 20) as f64,
                    p.edge
                )
            });
        }
        ImageCmd::List => {
            let l = client.list_images().await?;
            out.show(&l, |l| table(&IMAGE_HEADERS, l.images.iter().map(image_row).collect()));
        }
        ImageCmd::Get { name } => {
            let x = client.get_image(&name).await?;
            out.show(&x, |x| {
                let mut s = table(&IMAGE_HEADERS, vec![image_row(x)]);
                if let Some(p) = &x.progress {
                    s.push_str(&format!(
                        "\npulling on {}: {} of {} layers, {} of {} MB, {}",
                        x.edge,
                        p.layers_done,
                        p.layers_total,
                        p.bytes_done >> 20,
                        p.bytes_total >> 20,
                        p.phase
                    ));
                }
                s
            });
        }
        ImageCmd::Rm { name } => {
            let d = client.delete_image(&name).await?;
            out.show(&d, |d| format!("image {name} removed at index {}", d.index));
        }
        ImageCmd::Prune => {
            let p = client.prune_images().await?;
            out.show(&p, |p| {
                let rows = p
                    .edges
                    .iter()
                    .map(|e| {
                        vec![
                            e.edge.clone(),
                            e.layers.to_string(),
                            e.disks.to_string(),
                            e.scratch.to_string(),
                            format!("{:.1} MiB", e.bytes as f64 / (1 << 20) as f64),
                            e.error.clone().unwrap_or_default(),
                        ]
                    })
                    .collect();
                table(&["EDGE", "LAYERS", "DISKS", "SCRATCH", "FREED", "ERROR"], rows)
            });
            if p.edges.iter().any(|e| e.error.is_some()) {
                return Ok(1);
            }
        }
    }
    Ok(0)
}

/// `sandbox pack`: asks for the image and, unless `no_wait`, waits until the sandbox's
/// edge has made it (1 when it failed or is still being made at `wait_seconds`).
pub(crate) async fn pack(
    client: &Client,
    out: Printer,
    sandbox: &str,
    req: PackSandbox,
    no_wait: bool,
    wait_seconds: u64,
) -> Result<u8, ApiError> {
    let w = client.pack_sandbox(sandbox, &req).await?;
    let image = if no_wait {
        w.image
    } else {
        wait_pulled(client, w.image, Duration::from_secs(wait_seconds)).await?
    };
    out.show(&image, |x| table(&IMAGE_HEADERS, vec![image_row(x)]));
    if image.state == "failed" {
        eprintln!("hint: see the reason above; a path the pack cannot hold can be left out with --scrub PATH");
        return Ok(1);
    }
    if image.state == "pending" && !no_wait {
        eprintln!(
            "the pack is still running after {wait_seconds} s; follow it with `opendsecctl image get {}`",
            image.name
        );
        return Ok(1);
    }
    Ok(0)
}

/// Polls the image until its edge has pulled (or packed) it, or failed, or `limit` passed,
/// drawing the edge's progress on stderr when it is a terminal.
pub(crate) async fn wait_pulled(client: &Client, mut image: Image, limit: Duration) -> Result<Image, ApiError> {
    let started = Instant::now();
    let doing = if image.source_sandbox.is_some() {
        "packing"
    } else {
        "pulling"
    };
    let bar = bytes_bar(format!("{doing} {}", image.name));
    while image.state == "pending" && started.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(250)).await;
        image = client.get_image(&image.name).await?;
        match &image.progress {
            Some(p) => {
                bar.set_length(p.bytes_total.max(p.bytes_done));
                bar.set_position(p.bytes_done);
                bar.set_message(format!("layers {}/{} {}", p.layers_done, p.layers_total, p.phase));
            }
            None => bar.set_message(format!("waiting for edge {}", image.edge)),
        }
    }
    bar.finish_and_clear();
    Ok(image)
}

/// A progress bar of bytes on stderr (drawn only on a terminal), `prefix` before it.
/// 24 random hex digits: the id a push's progress is read under.
fn random_id() -> String {
    let mut b = [0u8; 12];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        // No entropy to be had: the time and pid keep concurrent pushes of one CLI apart.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        return format!("{t:x}-{}", std::process::id());
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn bytes_bar(prefix: String) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} {prefix} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {elapsed} {wide_msg}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.set_prefix(prefix);
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}
