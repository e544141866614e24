//! What changed in a view between two points: a flat list of JSON paths with
//! their value before and after.

use serde::Serialize;
use serde_json::Value;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Change {
    pub path: String,
    pub before: Option<Value>,
    pub after: Option<Value>,
}

/// Differences between two JSON documents, in path order. Arrays of records
/// (the audit view) are compared element by element.
pub fn diff(before: &Value, after: &Value) -> Vec<Change> {
    let mut out = Vec::new();
    walk("", Some(before), Some(after), &mut out);
    out
}

fn walk(path: &str, a: Option<&Value>, b: Option<&Value>, out: &mut Vec<Change>) {
    match (a, b) {
        (Some(Value::Object(x)), Some(Value::Object(y))) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                walk(&format!("{path}/{k}"), x.get(k), y.get(k), out);
            }
        }
        (Some(Value::Array(x)), Some(Value::Array(y))) => {
            for i in 0..x.len().max(y.len()) {
                walk(&format!("{path}/{i}"), x.get(i), y.get(i), out);
            }
        }
        (a, b) if a == b => {}
        (a, b) => out.push(Change {
            path: if path.is_empty() { "/".into() } else { path.to_string() },
            before: a.cloned(),
            after: b.cloned(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reports_added_removed_and_changed_leaves() {
        let a = json!({"s": {"x": {"state": "ready"}, "y": 1}});
        let b = json!({"s": {"x": {"state": "paused"}, "z": 2}});
        let d = diff(&a, &b);
        let paths: Vec<_> = d.iter().map(|c| c.path.as_str()).collect();
        assert_eq!(paths, ["/s/x/state", "/s/y", "/s/z"]);
        assert_eq!(d[1].after, None);
        assert_eq!(d[2].before, None);
    }
}
