//! Golden logs: real control-plane logs, one set per event schema version, frozen with
//! the views they must replay to. Replaying them in CI proves that today's binary still
//! reads every log ever written and folds it to the same views, byte for byte.
//!
//! Layout (see `README.md`): `golden/v<N>/<scenario>.log` holds the framed entries,
//! `golden/v<N>/<scenario>.expected/<view>.json` and `state.sha256` the expected result.

use opendsec_projections::replay::{Until, fold};
use opendsec_projections::{State, VIEW_NAMES};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Log entries as (log index, encoded `Batch`), in log order.
pub type Entries = Vec<(u64, Vec<u8>)>;

/// Bytes of one frame's header: u64 LE index, u32 LE payload length.
const HEADER: usize = 12;

/// The name of the file holding the expected state hash.
pub const HASH_FILE: &str = "state.sha256";

/// One golden log found under `golden/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoldenLog {
    /// The schema version its directory (`v<N>`) is filed under.
    pub schema_version: u32,
    /// The file stem, e.g. `control-plane-tour`.
    pub scenario: String,
    /// `golden/v<N>/<scenario>.log`
    pub log: PathBuf,
    /// `golden/v<N>/<scenario>.expected/`
    pub expected: PathBuf,
}

/// This crate's `golden/` directory.
pub fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("golden")
}

/// Every `v<N>/<scenario>.log` under `root`, ordered by version then scenario.
/// Directories not named `v<N>` are an error: a misnamed one would silently go untested.
pub fn golden_logs_in(root: &Path) -> io::Result<Vec<GoldenLog>> {
    let mut out = Vec::new();
    if !root.exists() {
        return Ok(out);
    }
    for dir in std::fs::read_dir(root)? {
        let dir = dir?;
        if !dir.file_type()?.is_dir() {
            continue;
        }
        let name = dir.file_name().to_string_lossy().into_owned();
        let version = name
            .strip_prefix('v')
            .and_then(|v| v.parse::<u32>().ok())
            .ok_or_else(|| {
                invalid(format!(
                    "{}: golden directories must be named v<N>",
                    dir.path().display()
                ))
            })?;
        for f in std::fs::read_dir(dir.path())? {
            let path = f?.path();
            if path.extension().is_some_and(|e| e == "log") {
                let scenario = path
                    .file_stem()
                    .expect("a .log file has a stem")
                    .to_string_lossy()
                    .into_owned();
                let expected = path.with_extension("expected");
                out.push(GoldenLog {
                    schema_version: version,
                    scenario,
                    log: path,
                    expected,
                });
            }
        }
    }
    out.sort_by(|a, b| (a.schema_version, &a.scenario).cmp(&(b.schema_version, &b.scenario)));
    Ok(out)
}

/// Every golden log of this crate.
pub fn golden_logs() -> io::Result<Vec<GoldenLog>> {
    golden_logs_in(&golden_dir())
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Encodes entries in the golden framing: per entry u64 LE index, u32 LE length, bytes.
pub fn encode_golden_log(entries: &[(u64, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.iter().map(|(_, b)| b.len() + HEADER).sum());
    for (index, bytes) in entries {
        let len = u32::try_from(bytes.len()).expect("a log entry is under 4 GiB");
        out.extend_from_slice(&index.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(bytes);
    }
    out
}

/// Decodes the golden framing. Refuses truncated frames and indices that do not grow.
pub fn decode_golden_log(mut data: &[u8]) -> io::Result<Vec<(u64, Vec<u8>)>> {
    let mut out: Vec<(u64, Vec<u8>)> = Vec::new();
    while !data.is_empty() {
        if data.len() < HEADER {
            return Err(invalid(format!(
                "truncated frame header: {} trailing bytes",
                data.len()
            )));
        }
        let index = u64::from_le_bytes(data[..8].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(data[8..HEADER].try_into().expect("4 bytes")) as usize;
        let body = &data[HEADER..];
        if body.len() < len {
            return Err(invalid(format!(
                "entry {index}: frame says {len} bytes, {} remain",
                body.len()
            )));
        }
        if let Some((prev, _)) = out.last()
            && index <= *prev
        {
            return Err(invalid(format!(
                "entry {index} follows entry {prev}: indices must grow"
            )));
        }
        out.push((index, body[..len].to_vec()));
        data = &body[len..];
    }
    Ok(out)
}

/// Reads a golden log file: (log index, encoded `Batch`) in log order.
pub fn read_golden_log(path: impl AsRef<Path>) -> io::Result<Vec<(u64, Vec<u8>)>> {
    let path = path.as_ref();
    let data = std::fs::read(path)?;
    decode_golden_log(&data).map_err(|e| invalid(format!("{}: {e}", path.display())))
}

/// Writes a golden log file.
pub fn write_golden_log(path: impl AsRef<Path>, entries: &[(u64, Vec<u8>)]) -> io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    f.write_all(&encode_golden_log(entries))?;
    f.sync_all()
}

/// Folds entries from the empty state, exactly as a node applies its log.
pub fn replay(entries: &[(u64, Vec<u8>)]) -> State {
    replay_from(State::new(), entries)
}

/// Folds the entries after `from.index` onto `from` (resuming from a checkpoint).
pub fn replay_from(from: State, entries: &[(u64, Vec<u8>)]) -> State {
    fold(
        from,
        entries.iter().map(|(i, b)| (*i, b.as_slice())),
        Until::Index(u64::MAX),
    )
    .0
}

/// A view as it is stored in an expected file: pretty JSON and a final newline.
pub fn view_file_text(state: &State, view: &str) -> String {
    let v = state
        .view_json(view)
        .unwrap_or_else(|| panic!("{view} is one of VIEW_NAMES"));
    let mut s = serde_json::to_string_pretty(&v).expect("a JSON value serialises");
    s.push('\n');
    s
}

/// Writes `<view>.json` for every view and `state.sha256` into `dir`.
pub fn write_expected(dir: &Path, state: &State) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for view in VIEW_NAMES {
        std::fs::write(dir.join(format!("{view}.json")), view_file_text(state, view))?;
    }
    std::fs::write(dir.join(HASH_FILE), format!("{}\n", state.hash()))
}

/// Reads an expected view file.
pub fn read_expected_view(dir: &Path, view: &str) -> io::Result<serde_json::Value> {
    let path = dir.join(format!("{view}.json"));
    let text = std::fs::read_to_string(&path)?;
    serde_json::from_str(&text).map_err(|e| invalid(format!("{}: {e}", path.display())))
}

/// Reads the expected state hash.
pub fn read_expected_hash(dir: &Path) -> io::Result<String> {
    Ok(std::fs::read_to_string(dir.join(HASH_FILE))?.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_framing_round_trips_and_refuses_damage() {
        let entries = vec![(1, vec![1, 2, 3]), (3, vec![]), (7, vec![9; 300])];
        let bytes = encode_golden_log(&entries);
        assert_eq!(decode_golden_log(&bytes).unwrap(), entries);
        assert!(decode_golden_log(&bytes[..bytes.len() - 1]).is_err(), "truncated body");
        assert!(decode_golden_log(&bytes[..5]).is_err(), "truncated header");
        let backwards = encode_golden_log(&[(2, vec![]), (2, vec![])]);
        assert!(decode_golden_log(&backwards).is_err(), "indices must grow");
    }
}
