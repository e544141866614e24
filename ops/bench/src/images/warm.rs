//! Warm: create -> first output of `echo hi` from the pulled image beside the same from
//! `base`, both already in the store, interleaved (pulled, base; then base, pulled; ...)
//! so that drift on the machine touches both alike; one warm-up round is not counted.
//! Each sandbox is deleted and freed before the next (as in the sandboxes benchmark).
//! The edge keeps warm containers for the two images created from most recently, which
//! are these two: both sides get them alike.

use std::time::Duration;

use super::{BASE, IMAGE_NAME, sandbox_body};
use crate::sandboxes::UpGuard;

pub(super) struct Warm {
    /// Sorted; the warm-up round is not in them.
    pub(super) pulled: Vec<Duration>,
    pub(super) base: Vec<Duration>,
    pub(super) errors: Vec<String>,
}

pub(super) async fn warm(up: &UpGuard, runs: usize) -> Warm {
    let mut w = Warm {
        pulled: Vec::new(),
        base: Vec::new(),
        errors: Vec::new(),
    };
    for i in 0..=runs {
        let order = if i % 2 == 0 {
            [IMAGE_NAME, BASE]
        } else {
            [BASE, IMAGE_NAME]
        };
        for image in order {
            let (id, r) = up.create_then_echo(&sandbox_body(image), Duration::from_secs(60)).await;
            match r {
                Ok(d) if i > 0 => {
                    if image == BASE { &mut w.base } else { &mut w.pulled }.push(d);
                }
                Ok(_) => {}
                Err(e) => w.errors.push(format!("{image}, round {i}: {e}")),
            }
            if let Some(id) = id
                && let Err(e) = up.remove(&id).await
            {
                w.errors.push(e);
            }
        }
        if w.errors.len() > 5 {
            break;
        }
    }
    w.pulled.sort_unstable();
    w.base.sort_unstable();
    w
}
