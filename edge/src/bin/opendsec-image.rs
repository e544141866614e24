//! The project's image tool: builds the default images into the local store.
//!
//!   opendsec-image build busybox|base|code-interpreter-v1 [--store DIR]
//!   opendsec-image list [--store DIR]

use std::io::Write;
use std::time::Instant;

use opendsec_edge::images::{BuildPhase, BuildProgress, DEFAULT_STORE, ImageStore, builder_names};

fn usage() -> ! {
    eprintln!(
        "usage: opendsec-image build <{}> [--store DIR]\n       opendsec-image list [--store DIR]",
        builder_names().join("|")
    );
    std::process::exit(2)
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut store_dir = DEFAULT_STORE.to_string();
    if let Some(i) = args.iter().position(|a| a == "--store") {
        if i + 1 >= args.len() {
            usage();
        }
        store_dir = args.remove(i + 1);
        args.remove(i);
    }
    let store = match ImageStore::open(&store_dir) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1)
        }
    };
    let result = match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["build", name] => build(&store, name),
        ["list"] => store.list().map(|images| {
            for image in images {
                println!(
                    "{}\tlayers={}\tshell={}",
                    image.name,
                    image.layers.join(","),
                    image.config.shell
                );
            }
        }),
        _ => usage(),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn build(store: &ImageStore, name: &str) -> Result<(), opendsec_edge::images::ImageError> {
    let start = Instant::now();
    let last_phase = std::cell::Cell::new(None::<BuildPhase>);
    let verbose = std::env::var_os("OPENDSEC_IMAGE_VERBOSE").is_some();
    let progress = |p: &BuildProgress| {
        // One line per phase (plus every tool line when OPENDSEC_IMAGE_VERBOSE is set).
        if last_phase.get() != Some(p.phase) || verbose {
            println!(
                "[{:>6.1}s] {:<9} {}",
                start.elapsed().as_secs_f64(),
                p.phase.to_string(),
                p.message
            );
            let _ = std::io::stdout().flush();
            last_phase.set(Some(p.phase));
        }
    };
    let image = store.ensure(name, &progress)?;
    println!(
        "{} ready in {:.1}s: layers {}",
        image.name,
        start.elapsed().as_secs_f64(),
        image.layers.join(",")
    );
    Ok(())
}
