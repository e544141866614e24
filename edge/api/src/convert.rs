//! The one place the slice protocol's enums meet the projections' types. Encoding always
//! succeeds; decoding refuses UNSPECIFIED and any value this binary does not know (a
//! newer control plane's), so a receiver never acts on a guess.

use crate::pb;
use opendsec_projections::{CpuClass, Desired, Isolation, Observed, SnapshotState};

/// An enum value in a slice message that this binary cannot interpret.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field} is {value}, a value this edge does not know (unspecified, or from a newer control plane)")]
pub struct UnknownEnum {
    /// The protobuf enum (`Desired`, `Observed`, `Isolation`, `SnapshotState`).
    pub field: &'static str,
    pub value: i32,
}

/// Declares the mapping between a protobuf enum and a projections enum once: the
/// encoding `From`, and `decode_*` from the wire's `i32`.
macro_rules! mapping {
    ($decode:ident, $field:literal, $pb:ident, $ours:ident { $($variant:ident <=> $wire:ident),* $(,)? }) => {
        impl From<$ours> for pb::$pb {
            fn from(v: $ours) -> pb::$pb {
                match v {
                    $($ours::$variant => pb::$pb::$wire,)*
                }
            }
        }

        impl TryFrom<pb::$pb> for $ours {
            type Error = UnknownEnum;
            fn try_from(v: pb::$pb) -> Result<$ours, UnknownEnum> {
                match v {
                    $(pb::$pb::$wire => Ok($ours::$variant),)*
                    pb::$pb::Unspecified => Err(UnknownEnum { field: $field, value: 0 }),
                }
            }
        }

        #[doc = concat!("Decodes a `", $field, "` field of a slice message.")]
        pub fn $decode(value: i32) -> Result<$ours, UnknownEnum> {
            pb::$pb::try_from(value)
                .map_err(|_| UnknownEnum { field: $field, value })
                .and_then($ours::try_from)
        }
    };
}

mapping!(decode_desired, "Desired", Desired, Desired {
    Running <=> Running,
    Paused <=> Paused,
    Killed <=> Killed,
});

mapping!(decode_observed, "Observed", Observed, Observed {
    Pending <=> Pending,
    Ready <=> Ready,
    Paused <=> Paused,
    Failed <=> Failed,
    Exited <=> Exited,
});

mapping!(decode_isolation, "Isolation", Isolation, Isolation {
    Container <=> Container,
    Microvm <=> Microvm,
    Vm <=> Vm,
});

mapping!(decode_cpu_class, "CpuClass", CpuClass, CpuClass {
    LatencySensitive <=> LatencySensitive,
    BestEffort <=> BestEffort,
});

mapping!(decode_snapshot_state, "SnapshotState", SnapshotState, SnapshotState {
    Pending <=> Pending,
    Ready <=> Ready,
    Failed <=> Failed,
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_survives_the_wire() {
        for d in [Desired::Running, Desired::Paused, Desired::Killed] {
            assert_eq!(decode_desired(pb::Desired::from(d).into()), Ok(d));
        }
        for o in [
            Observed::Pending,
            Observed::Ready,
            Observed::Paused,
            Observed::Failed,
            Observed::Exited,
        ] {
            assert_eq!(decode_observed(pb::Observed::from(o).into()), Ok(o));
        }
        for i in Isolation::ALL {
            assert_eq!(decode_isolation(pb::Isolation::from(i).into()), Ok(i));
        }
        for s in [SnapshotState::Pending, SnapshotState::Ready, SnapshotState::Failed] {
            assert_eq!(decode_snapshot_state(pb::SnapshotState::from(s).into()), Ok(s));
        }
        for c in CpuClass::ALL {
            assert_eq!(decode_cpu_class(pb::CpuClass::from(c).into()), Ok(c));
        }
    }

    #[test]
    fn unspecified_is_refused_not_defaulted() {
        assert_eq!(
            decode_isolation(0),
            Err(UnknownEnum {
                field: "Isolation",
                value: 0
            })
        );
        assert!(decode_desired(0).is_err());
        assert!(decode_observed(0).is_err());
        assert!(decode_snapshot_state(0).is_err());
        assert!(decode_cpu_class(0).is_err());
    }

    #[test]
    fn a_value_from_a_newer_control_plane_is_refused_with_its_number() {
        let e = decode_observed(42).unwrap_err();
        assert_eq!(e.value, 42);
        assert!(e.to_string().contains("Observed is 42"), "{e}");
    }
}
