//! Field and label selectors, and the filter a list or a watch applies.
//!
//! Field selectors: comma-separated `path=value`, `path==value`, `path!=value`, where `path` is any
//! dotted path into the object (`spec.nodeName`, `status.phase`); a missing field is the empty
//! string, a non-string one its JSON text (`true`). The real server accepts only a few fields per
//! kind; this one accepts them all, and has no escapes (`\,`). Label selectors: `k=v`, `k==v`,
//! `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`.

use serde_json::Value;

use super::Kind;

#[derive(Debug, Clone, PartialEq, Eq)]
struct FieldRequirement {
    path: Vec<String>,
    equal: bool,
    value: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelRequirement {
    Equal(String, String),
    NotEqual(String, String),
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// Which objects a list or a watch is about.
#[derive(Debug, Clone)]
pub(super) struct Filter {
    kind: Kind,
    namespace: Option<String>,
    fields: Vec<FieldRequirement>,
    labels: Vec<LabelRequirement>,
}

impl Filter {
    /// Parses the selectors; the error says what is wrong with them.
    pub(super) fn new(
        kind: Kind,
        namespace: Option<String>,
        fields: Option<&str>,
        labels: Option<&str>,
    ) -> Result<Filter, String> {
        Ok(Filter {
            kind,
            namespace,
            fields: parse_fields(fields.unwrap_or(""))?,
            labels: parse_labels(labels.unwrap_or(""))?,
        })
    }

    pub(super) fn kind(&self) -> Kind {
        self.kind
    }

    /// Whether an object of this filter's kind matches.
    pub(super) fn matches(&self, object: &Value) -> bool {
        let in_namespace = self
            .namespace
            .as_deref()
            .is_none_or(|ns| object.pointer("/metadata/namespace").and_then(Value::as_str) == Some(ns));
        in_namespace
            && self.fields.iter().all(|r| field_matches(object, r))
            && self.labels.iter().all(|r| label_matches(object, r))
    }
}

fn parse_fields(selector: &str) -> Result<Vec<FieldRequirement>, String> {
    selector
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|term| {
            let (path, equal, value) = if let Some((p, v)) = term.split_once("!=") {
                (p, false, v)
            } else if let Some((p, v)) = term.split_once("==") {
                (p, true, v)
            } else if let Some((p, v)) = term.split_once('=') {
                (p, true, v)
            } else {
                return Err(format!("invalid field selector: {term:?}: expected path=value or path!=value"));
            };
            let path = path.trim();
            if path.is_empty() || path.split('.').any(str::is_empty) {
                return Err(format!("invalid field selector: {term:?}: bad field path"));
            }
            Ok(FieldRequirement { path: path.split('.').map(str::to_owned).collect(), equal, value: value.to_owned() })
        })
        .collect()
}

fn field_matches(object: &Value, requirement: &FieldRequirement) -> bool {
    let found = requirement.path.iter().try_fold(object, |v, part| v.get(part));
    let actual = match found {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    };
    (actual == requirement.value) == requirement.equal
}

/// Splits on the commas that are not inside parentheses.
fn split_top_level(selector: &str) -> Vec<&str> {
    let mut terms = Vec::new();
    let mut depth = 0_i32;
    let mut start = 0;
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&selector[start..]);
    terms
}

fn valid_label_key(key: &str) -> bool {
    !key.is_empty()
        && key.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
        && !key.starts_with('/')
}

fn parse_labels(selector: &str) -> Result<Vec<LabelRequirement>, String> {
    split_top_level(selector)
        .into_iter()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|term| {
            let bad = |why: &str| format!("unable to parse requirement: {term:?}: {why}");
            let requirement = if let Some(key) = term.strip_prefix('!') {
                LabelRequirement::NotExists(key.trim().to_owned())
            } else if let Some((left, rest)) = term.split_once('(') {
                let Some(inside) = rest.trim_end().strip_suffix(')') else {
                    return Err(bad("missing ')'"));
                };
                let values: Vec<String> =
                    inside.split(',').map(str::trim).filter(|v| !v.is_empty()).map(str::to_owned).collect();
                let mut words = left.split_whitespace();
                match (words.next(), words.next(), words.next()) {
                    (Some(key), Some("in"), None) => LabelRequirement::In(key.to_owned(), values),
                    (Some(key), Some("notin"), None) => LabelRequirement::NotIn(key.to_owned(), values),
                    _ => return Err(bad("expected 'key in (values)' or 'key notin (values)'")),
                }
            } else if let Some((k, v)) = term.split_once("!=") {
                LabelRequirement::NotEqual(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                LabelRequirement::Equal(k.trim().to_owned(), v.trim().to_owned())
            } else {
                LabelRequirement::Exists(term.to_owned())
            };
            let key = match &requirement {
                LabelRequirement::Equal(k, _)
                | LabelRequirement::NotEqual(k, _)
                | LabelRequirement::Exists(k)
                | LabelRequirement::NotExists(k)
                | LabelRequirement::In(k, _)
                | LabelRequirement::NotIn(k, _) => k,
            };
            if valid_label_key(key) { Ok(requirement) } else { Err(bad("invalid label key")) }
        })
        .collect()
}

fn label_matches(object: &Value, requirement: &LabelRequirement) -> bool {
    let label = |k: &str| object.pointer("/metadata/labels").and_then(|l| l.get(k)).and_then(Value::as_str);
    match requirement {
        LabelRequirement::Equal(k, v) => label(k) == Some(v.as_str()),
        LabelRequirement::NotEqual(k, v) => label(k) != Some(v.as_str()),
        LabelRequirement::Exists(k) => label(k).is_some(),
        LabelRequirement::NotExists(k) => label(k).is_none(),
        LabelRequirement::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
        LabelRequirement::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn filter(fields: &str, labels: &str) -> Filter {
        Filter::new(Kind::Pod, None, Some(fields), Some(labels)).unwrap()
    }

    #[test]
    fn field_selectors_compare_any_dotted_path() {
        let pod = json!({"metadata": {"name": "p", "namespace": "ns"}, "spec": {"nodeName": "a", "hostNetwork": true}});
        assert!(filter("spec.nodeName=a", "").matches(&pod));
        assert!(filter("spec.nodeName==a,metadata.name=p", "").matches(&pod));
        assert!(filter("spec.nodeName!=b, metadata.namespace=ns", "").matches(&pod));
        assert!(!filter("spec.nodeName=b", "").matches(&pod));
        assert!(filter("status.phase!=Running", "").matches(&pod));
        assert!(filter("status.phase=", "").matches(&pod));
        assert!(filter("spec.hostNetwork=true", "").matches(&pod));
        assert!(Filter::new(Kind::Pod, None, Some("spec.nodeName"), None).is_err());
        assert!(Filter::new(Kind::Pod, None, Some("spec..x=1"), None).is_err());
    }

    #[test]
    fn label_selectors_support_equality_existence_and_sets() {
        let pod = json!({"metadata": {"name": "p", "labels": {"app": "x", "tier": "gpu"}}});
        for yes in ["app=x", "app==x", "app", "!missing", "app in (x, y)", "tier notin (cpu)", "app,tier=gpu", ""] {
            assert!(filter("", yes).matches(&pod), "{yes}");
        }
        for no in ["app!=x", "missing", "!app", "app in (y)", "app notin (x,y)", "app=x,tier=cpu"] {
            assert!(!filter("", no).matches(&pod), "{no}");
        }
        assert!(Filter::new(Kind::Pod, None, None, Some("app in (x")).is_err());
        assert!(Filter::new(Kind::Pod, None, None, Some("a b c")).is_err());
    }

    #[test]
    fn a_namespace_filter_excludes_other_namespaces() {
        let f = Filter::new(Kind::Pod, Some("a".into()), None, None).unwrap();
        assert!(f.matches(&json!({"metadata": {"namespace": "a"}})));
        assert!(!f.matches(&json!({"metadata": {"namespace": "b"}})));
    }
}
