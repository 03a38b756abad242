//! The three patch formats of `PATCH`: JSON merge patch (RFC 7386), strategic merge patch, and
//! JSON patch (RFC 6902).
//!
//! The strategic merge patch is a merge patch in which the lists Kubernetes declares with a merge
//! key merge by that key, whatever the parent (`containers`, `initContainers`, `env`, `volumes` by
//! `name`; `ports` by `containerPort`; `volumeMounts` by `mountPath`; `conditions` and `addresses`
//! by `type`; `ownerReferences` by `uid`; …), `finalizers` merge as a set, and the directives
//! `$patch: delete|replace|merge` and `$deleteFromPrimitiveList/<field>` are honoured;
//! `$setElementOrder/…` and `$retainKeys` are accepted and ignored. Every other list is replaced.

use serde_json::{Map, Value};

/// RFC 7386 JSON merge patch: objects merge, `null` removes a key, anything else replaces.
pub(super) fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(target) = target {
        for (key, value) in patch {
            if value.is_null() {
                target.remove(key);
            } else {
                merge_patch(target.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

/// The merge key of a list field, by the field's name, as Kubernetes' core/v1 types declare it.
fn merge_key(field: &str) -> Option<&'static str> {
    Some(match field {
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "env"
        | "volumes"
        | "imagePullSecrets"
        | "resourceClaims"
        | "schedulingGates" => "name",
        "ports" => "containerPort",
        "volumeMounts" => "mountPath",
        "volumeDevices" => "devicePath",
        "conditions" | "addresses" => "type",
        "ownerReferences" => "uid",
        "podIPs" | "hostIPs" | "hostAliases" => "ip",
        "topologySpreadConstraints" => "topologyKey",
        _ => return None,
    })
}

/// Lists of strings that merge as sets.
fn is_set_list(field: &str) -> bool {
    matches!(field, "finalizers" | "podCIDRs")
}

/// Removes the strategic-merge directives from a value being inserted.
fn strip_directives(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.retain(|k, _| !k.starts_with('$'));
            map.values_mut().for_each(strip_directives);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_directives),
        _ => {}
    }
}

/// Strategic merge patch, as described in the module documentation.
pub(super) fn strategic_merge_patch(target: &mut Value, patch: &Value) -> Result<(), String> {
    let Value::Object(patch) = patch else {
        let mut replacement = patch.clone();
        strip_directives(&mut replacement);
        *target = replacement;
        return Ok(());
    };
    match patch.get("$patch").map(|d| d.as_str().unwrap_or("")) {
        None | Some("merge") => {}
        Some("replace") => {
            let mut replacement = Value::Object(patch.clone());
            strip_directives(&mut replacement);
            *target = replacement;
            return Ok(());
        }
        Some("delete") => {
            *target = Value::Object(Map::new());
            return Ok(());
        }
        Some(other) => return Err(format!("unknown strategic merge patch directive $patch: {other:?}")),
    }
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(target) = target else { return Ok(()) };
    for (key, value) in patch {
        if let Some(field) = key.strip_prefix("$deleteFromPrimitiveList/") {
            let Value::Array(doomed) = value else {
                return Err(format!("{key} must be a list"));
            };
            if let Some(Value::Array(items)) = target.get_mut(field) {
                items.retain(|i| !doomed.contains(i));
            }
            continue;
        }
        if key.starts_with('$') {
            continue;
        }
        match value {
            Value::Null => {
                target.remove(key);
            }
            Value::Array(items) => {
                let slot = target.entry(key.clone()).or_insert(Value::Null);
                if let (Some(merge_key), Value::Array(existing)) = (merge_key(key), &mut *slot) {
                    merge_keyed_list(existing, items, merge_key)?;
                } else if let (true, Value::Array(existing)) = (is_set_list(key), &mut *slot) {
                    for item in items {
                        if !existing.contains(item) {
                            existing.push(item.clone());
                        }
                    }
                } else {
                    let mut replacement = Value::Array(items.clone());
                    strip_directives(&mut replacement);
                    *slot = replacement;
                }
            }
            Value::Object(inner) if inner.get("$patch").and_then(Value::as_str) == Some("delete") => {
                target.remove(key);
            }
            Value::Object(_) => {
                let slot = target.entry(key.clone()).or_insert(Value::Null);
                strategic_merge_patch(slot, value)?;
            }
            other => {
                target.insert(key.clone(), other.clone());
            }
        }
    }
    Ok(())
}

fn merge_keyed_list(existing: &mut Vec<Value>, items: &[Value], key: &str) -> Result<(), String> {
    if items.iter().any(|i| i.get("$patch").and_then(Value::as_str) == Some("replace")) {
        let mut replacement: Vec<Value> =
            items.iter().filter(|i| i.get("$patch").and_then(Value::as_str) != Some("replace")).cloned().collect();
        replacement.iter_mut().for_each(strip_directives);
        *existing = replacement;
        return Ok(());
    }
    for item in items {
        let Some(id) = item.get(key) else {
            let mut added = item.clone();
            strip_directives(&mut added);
            existing.push(added);
            continue;
        };
        let position = existing.iter().position(|e| e.get(key) == Some(id));
        let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
        match (position, delete) {
            (Some(i), true) => {
                existing.remove(i);
            }
            (None, true) => {}
            (Some(i), false) => {
                if let Some(slot) = existing.get_mut(i) {
                    strategic_merge_patch(slot, item)?;
                }
            }
            (None, false) => {
                let mut added = item.clone();
                strip_directives(&mut added);
                existing.push(added);
            }
        }
    }
    Ok(())
}

/// Why a JSON patch was refused: malformed (`400`) or not applicable to this object (`422`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum JsonPatchError {
    Malformed(String),
    Failed(String),
}

/// One JSON pointer (RFC 6901), split into unescaped tokens.
fn pointer(path: &str) -> Result<Vec<String>, JsonPatchError> {
    if path.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = path.strip_prefix('/') else {
        return Err(JsonPatchError::Malformed(format!("invalid JSON pointer {path:?}: it must start with '/'")));
    };
    Ok(rest.split('/').map(|t| t.replace("~1", "/").replace("~0", "~")).collect())
}

fn failed(message: String) -> JsonPatchError {
    JsonPatchError::Failed(message)
}

fn array_index(token: &str, len: usize, path: &str, allow_end: bool) -> Result<usize, JsonPatchError> {
    if allow_end && token == "-" {
        return Ok(len);
    }
    let index: usize = token
        .parse()
        .ok()
        .filter(|_| !token.starts_with('+') && (token == "0" || !token.starts_with('0')))
        .ok_or_else(|| failed(format!("invalid array index {token:?} in {path:?}")))?;
    let limit = if allow_end { len } else { len.saturating_sub(1) };
    if index > limit || (!allow_end && len == 0) {
        return Err(failed(format!("array index {index} out of bounds in {path:?}")));
    }
    Ok(index)
}

/// The value at `tokens`, if any.
fn resolve<'a>(doc: &'a mut Value, tokens: &[String], path: &str) -> Result<&'a mut Value, JsonPatchError> {
    let mut current = doc;
    for token in tokens {
        current = match current {
            Value::Object(map) => map.get_mut(token).ok_or_else(|| failed(format!("path {path:?} does not exist")))?,
            Value::Array(items) => {
                let i = array_index(token, items.len(), path, false)?;
                items.get_mut(i).ok_or_else(|| failed(format!("path {path:?} does not exist")))?
            }
            _ => return Err(failed(format!("path {path:?} does not exist"))),
        };
    }
    Ok(current)
}

fn add(doc: &mut Value, path: &str, value: Value) -> Result<(), JsonPatchError> {
    let tokens = pointer(path)?;
    let Some((last, parent)) = tokens.split_last() else {
        *doc = value;
        return Ok(());
    };
    match resolve(doc, parent, path)? {
        Value::Object(map) => {
            map.insert(last.clone(), value);
        }
        Value::Array(items) => {
            let i = array_index(last, items.len(), path, true)?;
            items.insert(i, value);
        }
        _ => return Err(failed(format!("the parent of {path:?} is not an object or a list"))),
    }
    Ok(())
}

fn remove(doc: &mut Value, path: &str) -> Result<Value, JsonPatchError> {
    let tokens = pointer(path)?;
    let Some((last, parent)) = tokens.split_last() else {
        return Err(failed("cannot remove the whole document".into()));
    };
    match resolve(doc, parent, path)? {
        Value::Object(map) => map.remove(last).ok_or_else(|| failed(format!("path {path:?} does not exist"))),
        Value::Array(items) => {
            let i = array_index(last, items.len(), path, false)?;
            Ok(items.remove(i))
        }
        _ => Err(failed(format!("path {path:?} does not exist"))),
    }
}

/// RFC 6902 JSON patch: `add`, `remove`, `replace`, `move`, `copy` and `test`, all or nothing
/// (the caller applies it to a copy).
pub(super) fn json_patch(doc: &mut Value, patch: &Value) -> Result<(), JsonPatchError> {
    let Value::Array(operations) = patch else {
        return Err(JsonPatchError::Malformed("a JSON patch must be a list of operations".into()));
    };
    for operation in operations {
        let field = |name: &str| operation.get(name).and_then(Value::as_str);
        let Some(op) = field("op") else {
            return Err(JsonPatchError::Malformed(format!("operation {operation} has no \"op\"")));
        };
        let Some(path) = field("path") else {
            return Err(JsonPatchError::Malformed(format!("operation {operation} has no \"path\"")));
        };
        let value = || {
            operation
                .get("value")
                .cloned()
                .ok_or_else(|| JsonPatchError::Malformed(format!("operation {operation} has no \"value\"")))
        };
        let from =
            || field("from").ok_or_else(|| JsonPatchError::Malformed(format!("operation {operation} has no \"from\"")));
        match op {
            "add" => add(doc, path, value()?)?,
            "remove" => {
                remove(doc, path)?;
            }
            "replace" => {
                let tokens = pointer(path)?;
                *resolve(doc, &tokens, path)? = value()?;
            }
            "move" => {
                let from = from()?;
                if path.starts_with(&format!("{from}/")) {
                    return Err(failed(format!("cannot move {from:?} into its own child {path:?}")));
                }
                let moved = remove(doc, from)?;
                add(doc, path, moved)?;
            }
            "copy" => {
                let from = from()?;
                let copied = resolve(doc, &pointer(from)?, from)?.clone();
                add(doc, path, copied)?;
            }
            "test" => {
                let expected = value()?;
                let actual = resolve(doc, &pointer(path)?, path)?;
                if *actual != expected {
                    return Err(failed(format!("test failed: {path:?} is {actual}, not {expected}")));
                }
            }
            other => return Err(JsonPatchError::Malformed(format!("unknown JSON patch operation {other:?}"))),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn merge_patch_merges_objects_removes_nulls_and_replaces_lists() {
        let mut v = json!({"a": {"b": 1, "c": 2}, "l": [1, 2]});
        merge_patch(&mut v, &json!({"a": {"b": null, "d": {"e": null, "f": 3}}, "l": [3]}));
        assert_eq!(v, json!({"a": {"c": 2, "d": {"f": 3}}, "l": [3]}));
        merge_patch(&mut v, &json!("x"));
        assert_eq!(v, json!("x"));
    }

    #[test]
    fn strategic_merge_patch_merges_containers_by_name() {
        let mut pod = json!({"metadata": {"finalizers": ["a"]}, "spec": {"containers": [
            {"name": "a", "image": "1", "env": [{"name": "X", "value": "1"}]},
            {"name": "b", "image": "1"}], "tolerations": [{"key": "t"}]}});
        let patch = json!({"metadata": {"finalizers": ["b", "a"]}, "spec": {
            "$setElementOrder/containers": [{"name": "a"}, {"name": "b"}],
            "containers": [{"name": "a", "image": "2", "env": [{"name": "Y", "value": "2"}]},
                           {"name": "b", "$patch": "delete"}, {"name": "c", "image": "3"}],
            "tolerations": [{"key": "u"}]}});
        strategic_merge_patch(&mut pod, &patch).unwrap();
        assert_eq!(
            pod,
            json!({"metadata": {"finalizers": ["a", "b"]}, "spec": {"containers": [
                {"name": "a", "image": "2", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]},
                {"name": "c", "image": "3"}], "tolerations": [{"key": "u"}]}})
        );
        strategic_merge_patch(
            &mut pod,
            &json!({"metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]},
            "spec": {"$patch": "replace", "x": 1}, "status": {"$patch": "delete"}}),
        )
        .unwrap();
        assert_eq!(pod, json!({"metadata": {"finalizers": ["b"]}, "spec": {"x": 1}}));
        assert!(strategic_merge_patch(&mut pod, &json!({"$patch": "bogus"})).is_err());
    }

    #[test]
    fn json_patch_applies_the_six_operations() {
        let mut v = json!({"a": {"b": [1, 2]}, "c/d": "x", "e~f": 1});
        let ops = json!([
            {"op": "add", "path": "/a/b/-", "value": 3},
            {"op": "add", "path": "/a/b/0", "value": 0},
            {"op": "remove", "path": "/c~1d"},
            {"op": "replace", "path": "/e~0f", "value": 2},
            {"op": "copy", "from": "/a/b", "path": "/g"},
            {"op": "move", "from": "/g", "path": "/h"},
            {"op": "test", "path": "/h/3", "value": 3},
        ]);
        json_patch(&mut v, &ops).unwrap();
        assert_eq!(v, json!({"a": {"b": [0, 1, 2, 3]}, "e~f": 2, "h": [0, 1, 2, 3]}));
        let failures = [
            json!([{"op": "test", "path": "/e~0f", "value": 3}]),
            json!([{"op": "remove", "path": "/nope"}]),
            json!([{"op": "replace", "path": "/a/b/9", "value": 1}]),
            json!([{"op": "add", "path": "/x/y", "value": 1}]),
            json!([{"op": "move", "from": "/a", "path": "/a/b/c"}]),
        ];
        for f in failures {
            assert!(matches!(json_patch(&mut v.clone(), &f), Err(JsonPatchError::Failed(_))), "{f}");
        }
        for m in [json!({}), json!([{"path": "/a"}]), json!([{"op": "add", "path": "/a"}]), json!([{"op": "x"}])] {
            assert!(matches!(json_patch(&mut v.clone(), &m), Err(JsonPatchError::Malformed(_))), "{m}");
        }
        assert!(matches!(
            json_patch(&mut v, &json!([{"op": "add", "path": "a", "value": 1}])),
            Err(JsonPatchError::Malformed(_))
        ));
    }
}
