//! Request bodies of the E2B control API: lenient about unknown fields (the SDKs add
//! them over releases), strict about the types of the fields OpenDsec reads, so a wrong
//! type is a 400 naming the field rather than a default.

use axum::body::Bytes;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

use super::api::{E2bError, R};

pub(super) fn body_object(bytes: &Bytes) -> R<Map<String, Value>> {
    if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(Value::Null) => Ok(Map::new()),
        Ok(_) => Err(E2bError::bad("the body must be a JSON object")),
        Err(e) => Err(E2bError::bad(format!("the body is not valid JSON: {e}"))),
    }
}

pub(super) fn opt_u64(m: &Map<String, Value>, field: &str) -> R<Option<u64>> {
    match m.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| E2bError::bad(format!("{field} must be a non-negative integer"))),
    }
}

pub(super) fn opt_bool(m: &Map<String, Value>, field: &str) -> R<Option<bool>> {
    match m.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(E2bError::bad(format!("{field} must be a boolean"))),
    }
}

pub(super) fn opt_str<'a>(m: &'a Map<String, Value>, field: &str) -> R<Option<&'a str>> {
    match m.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(E2bError::bad(format!("{field} must be a string"))),
    }
}

pub(super) fn string_map(m: &Map<String, Value>, field: &str) -> R<BTreeMap<String, String>> {
    match m.get(field) {
        None | Some(Value::Null) => Ok(BTreeMap::new()),
        Some(Value::Object(o)) => o
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                _ => Err(E2bError::bad(format!("{field}.{k} must be a string"))),
            })
            .collect(),
        Some(_) => Err(E2bError::bad(format!("{field} must be an object of strings"))),
    }
}

pub(super) fn unsupported(m: &Map<String, Value>, field: &str) -> R<()> {
    match m.get(field) {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Array(a)) if a.is_empty() => Ok(()),
        Some(Value::Object(o)) if o.is_empty() => Ok(()),
        Some(_) => Err(E2bError::bad(format!("{field} is not supported by OpenDsec yet"))),
    }
}
