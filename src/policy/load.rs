//! Policies from YAML files and directories, for `sluice serve`: the same RateLimitPolicy
//! documents `kubectl apply` takes, several per file separated by `---`.
//!
//! Loading is all or nothing: one bad document fails the whole load (and every problem is
//! reported), so a half-edited file never silently drops a policy on hot reload; the caller keeps
//! the previous snapshot instead.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_yaml::Value;

use super::Snapshot;
use super::compile::validate;
use super::crd::RateLimitPolicy;
use super::errors::ValidationErrors;

const API_VERSION: &str = "sluice.dev/v1alpha1";
const KIND: &str = "RateLimitPolicy";

/// A policy and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedPolicy {
    pub file: PathBuf,
    /// 1-based position of the YAML document in its file.
    pub document: usize,
    pub policy: RateLimitPolicy,
}

/// One loading problem, naming the file and, where there is one, the document.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LoadError {
    #[error("{}: {message}", file.display())]
    File { file: PathBuf, message: String },
    /// YAML syntax, apiVersion/kind or a field of the wrong type, with its path in `message`.
    #[error("{}: document {document}: {message}", file.display())]
    Document { file: PathBuf, document: usize, message: String },
    #[error("{}: document {document}: policy {policy}: {errors}", file.display())]
    Invalid { file: PathBuf, document: usize, policy: String, errors: ValidationErrors },
    #[error("policy {policy} is defined twice: {} document {first_document} and {} document {document}", first_file.display(), file.display())]
    Duplicate { policy: String, first_file: PathBuf, first_document: usize, file: PathBuf, document: usize },
}

/// Every problem of one load (never empty when returned as an error), one per line.
#[derive(Debug, Clone, Default, PartialEq, thiserror::Error)]
pub struct LoadErrors(pub Vec<LoadError>);

impl fmt::Display for LoadErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// The files `paths` stand for: files as given, directories' `*.yaml` and `*.yml` files (not
/// recursive), each directory's files sorted by name.
pub fn policy_files<P: AsRef<Path>>(paths: &[P]) -> Result<Vec<PathBuf>, LoadErrors> {
    let mut files = Vec::new();
    let mut errors = Vec::new();
    for path in paths {
        let path = path.as_ref();
        if path.is_dir() {
            match std::fs::read_dir(path) {
                Ok(entries) => {
                    let mut found: Vec<PathBuf> =
                        entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| is_yaml_file(p)).collect();
                    found.sort();
                    files.extend(found);
                }
                Err(e) => errors.push(LoadError::File { file: path.to_path_buf(), message: e.to_string() }),
            }
        } else {
            files.push(path.to_path_buf());
        }
    }
    if errors.is_empty() { Ok(files) } else { Err(LoadErrors(errors)) }
}

/// Why `paths`, read by [`load_paths`], held no RateLimitPolicy document: a sentence per path for
/// the message that refuses an empty policy set. A directory whose subdirectories hold YAML is
/// the likely mistake (loading is not recursive: `--policies examples` when the policies sit in
/// `examples/policies`, a ConfigMap mounted one level off), so those are named.
pub fn why_empty<P: AsRef<Path>>(paths: &[P]) -> String {
    let mut reasons = Vec::new();
    for path in paths {
        let path = path.as_ref();
        let shown = path.display();
        if !path.is_dir() {
            reasons.push(format!("{shown} holds none (it is empty, or only comments)"));
            continue;
        }
        let mut own = yaml_files_in(path);
        own.sort();
        let mut below: Vec<PathBuf> = std::fs::read_dir(path)
            .map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_dir()).collect())
            .unwrap_or_default();
        below.retain(|dir| !yaml_files_in(dir).is_empty());
        below.sort();
        let files = match own.as_slice() {
            [] => "has no *.yaml or *.yml files".to_string(),
            [file] => format!("has one *.yaml/*.yml file, {}, which holds none", file.display()),
            files => format!("has {} *.yaml/*.yml files, which hold none: {}", files.len(), shown_list(files)),
        };
        // `policies` is where such a tree usually keeps them (this repository's examples do).
        let likeliest = below.iter().find(|d| d.file_name().is_some_and(|n| n == "policies")).or(below.first());
        let hint = match likeliest {
            None => String::new(),
            Some(meant) => format!(
                "; its subdirectories are not read, and {} hold YAML files: name the one meant, e.g. --policies {}",
                shown_list(&below),
                meant.display()
            ),
        };
        reasons.push(format!("directory {shown} {files}{hint}"));
    }
    reasons.join("; ")
}

/// The first few of `paths`, comma-separated, `…` standing for the rest.
fn shown_list(paths: &[PathBuf]) -> String {
    const SHOWN: usize = 4;
    let mut names: Vec<String> = paths.iter().take(SHOWN).map(|p| p.display().to_string()).collect();
    if paths.len() > SHOWN {
        names.push("…".into());
    }
    names.join(", ")
}

fn is_yaml_file(path: &Path) -> bool {
    path.is_file() && matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml"))
}

/// The `*.yaml` and `*.yml` files directly in `dir` (none when it cannot be read).
fn yaml_files_in(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| is_yaml_file(p)).collect())
        .unwrap_or_default()
}

/// Loads, parses and validates every policy under `paths` (files or directories).
pub fn load_paths<P: AsRef<Path>>(paths: &[P]) -> Result<Vec<LoadedPolicy>, LoadErrors> {
    read_paths(paths, Validate::Each)
}

/// [`load_paths`] without validating the policies: for a caller that compiles them next (compile
/// validates each once) and reports its rejections with [`LoadedPolicy::file`] and `document`.
pub fn parse_paths<P: AsRef<Path>>(paths: &[P]) -> Result<Vec<LoadedPolicy>, LoadErrors> {
    read_paths(paths, Validate::Later)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Validate {
    Each,
    Later,
}

fn read_paths<P: AsRef<Path>>(paths: &[P], validate: Validate) -> Result<Vec<LoadedPolicy>, LoadErrors> {
    let files = policy_files(paths)?;
    let mut loaded = Vec::new();
    let mut errors = Vec::new();
    for file in files {
        match std::fs::read_to_string(&file) {
            Ok(text) => match read_str(&text, &file, validate) {
                Ok(policies) => loaded.extend(policies),
                Err(LoadErrors(e)) => errors.extend(e),
            },
            Err(e) => errors.push(LoadError::File { file, message: e.to_string() }),
        }
    }
    let mut seen: HashMap<String, (PathBuf, usize)> = HashMap::new();
    for p in &loaded {
        let name = p.policy.qualified_name();
        if let Some((first_file, first_document)) = seen.get(&name) {
            errors.push(LoadError::Duplicate {
                policy: name,
                first_file: first_file.clone(),
                first_document: *first_document,
                file: p.file.clone(),
                document: p.document,
            });
        } else {
            seen.insert(name, (p.file.clone(), p.document));
        }
    }
    if errors.is_empty() { Ok(loaded) } else { Err(LoadErrors(errors)) }
}

/// Parses and validates the documents of one file's text; `file` only names it in errors.
pub fn load_str(text: &str, file: &Path) -> Result<Vec<LoadedPolicy>, LoadErrors> {
    read_str(text, file, Validate::Each)
}

fn read_str(text: &str, file: &Path, validate_each: Validate) -> Result<Vec<LoadedPolicy>, LoadErrors> {
    let mut loaded = Vec::new();
    let mut errors = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let document = i + 1;
        let doc_error = |message: String| LoadError::Document { file: file.to_path_buf(), document, message };
        let value = match Value::deserialize(doc) {
            Ok(v) => v,
            Err(e) => {
                errors.push(doc_error(e.to_string()));
                // After a syntax error the rest of the stream cannot be trusted.
                break;
            }
        };
        if value.is_null() {
            continue;
        }
        match parse_document(value) {
            Ok(mut policy) => {
                if policy.metadata.namespace.as_deref().is_none_or(str::is_empty) {
                    policy.metadata.namespace = Some(super::DEFAULT_NAMESPACE.to_string());
                }
                match if validate_each == Validate::Each { validate(&policy) } else { Ok(()) } {
                    Ok(()) => loaded.push(LoadedPolicy { file: file.to_path_buf(), document, policy }),
                    Err(errs) => errors.push(LoadError::Invalid {
                        file: file.to_path_buf(),
                        document,
                        policy: policy.qualified_name(),
                        errors: errs,
                    }),
                }
            }
            Err(messages) => errors.extend(messages.into_iter().map(doc_error)),
        }
    }
    if errors.is_empty() { Ok(loaded) } else { Err(LoadErrors(errors)) }
}

fn parse_document(value: Value) -> Result<RateLimitPolicy, Vec<String>> {
    let field = |name: &str| value.get(name).and_then(Value::as_str).map(str::to_string);
    let mut problems = Vec::new();
    match field("apiVersion") {
        Some(v) if v == API_VERSION => {}
        Some(v) => problems.push(format!("apiVersion: expected {API_VERSION}, got {v:?}")),
        None => problems.push(format!("apiVersion: required ({API_VERSION})")),
    }
    match field("kind") {
        Some(k) if k == KIND => {}
        Some(k) => problems.push(format!("kind: expected {KIND}, got {k:?}")),
        None => problems.push(format!("kind: required ({KIND})")),
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    // Unknown fields are looked for first, against the CRD's own schema: a misspelt required
    // field (`algoritm:`) would otherwise be reported as the missing `algorithm`, and a
    // misspelt optional one (`brust:`) would vanish silently. The API server prunes unknown
    // fields and `kubectl apply` refuses them; a file has neither.
    if let Value::Mapping(map) = &value {
        for key in map.keys().filter_map(Value::as_str) {
            if !matches!(key, "apiVersion" | "kind" | "metadata" | "spec" | "status") {
                problems.push(format!("{key}: unknown field"));
            }
        }
    }
    if let (Some(spec), Some(schema)) = (value.get("spec"), spec_schema()) {
        unknown_fields(spec, schema, "spec", &mut problems);
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    match serde_path_to_error::deserialize(value) {
        Ok(policy) => Ok(policy),
        Err(e) => {
            let path = e.path().to_string();
            let message = in_yaml_terms(&e.inner().to_string(), &path);
            Err(vec![format!("{path}: {message}")])
        }
    }
}

/// The OpenAPI schema of `spec`, as the generated CRD states it: the one list of the fields a
/// policy has, so a file is held to exactly what the API server would accept.
fn spec_schema() -> Option<&'static serde_json::Value> {
    static SCHEMA: std::sync::OnceLock<Option<serde_json::Value>> = std::sync::OnceLock::new();
    SCHEMA
        .get_or_init(|| {
            use kube::CustomResourceExt;
            let crd = serde_json::to_value(RateLimitPolicy::crd()).ok()?;
            crd.pointer("/spec/versions/0/schema/openAPIV3Schema/properties/spec").cloned()
        })
        .as_ref()
}

/// Pushes `path.field: unknown field` for every key of `input` that `schema` does not declare,
/// with the declared field it is likely a misspelling of.
fn unknown_fields(input: &Value, schema: &serde_json::Value, path: &str, problems: &mut Vec<String>) {
    match input {
        Value::Mapping(map) => {
            let Some(properties) = schema.get("properties").and_then(serde_json::Value::as_object) else {
                // A map of free keys (`headers`, `matchLabels`): its values may still be objects.
                if let Some(values) = schema.get("additionalProperties").filter(|v| v.is_object()) {
                    for (k, v) in map {
                        let name = k.as_str().map_or_else(|| format!("{k:?}"), str::to_string);
                        unknown_fields(v, values, &format!("{path}.{name}"), problems);
                    }
                }
                return;
            };
            for (k, v) in map {
                let Some(name) = k.as_str() else { continue };
                let child = format!("{path}.{name}");
                match properties.get(name) {
                    Some(field_schema) => unknown_fields(v, field_schema, &child, problems),
                    None => {
                        let hint = closest(name, properties.keys().map(String::as_str))
                            .map(|known| format!(" (did you mean `{known}`?)"))
                            .unwrap_or_default();
                        problems.push(format!("{child}: unknown field `{name}`{hint}"));
                    }
                }
            }
        }
        Value::Sequence(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (n, item) in items.iter().enumerate() {
                    unknown_fields(item, item_schema, &format!("{path}[{n}]"), problems);
                }
            }
        }
        _ => {}
    }
}

/// The declared field `name` is most likely a misspelling of: a small edit away, or differing
/// only in case (`clientIp` for `clientIP`).
fn closest<'a>(name: &str, known: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let lower = name.to_ascii_lowercase();
    known
        .map(|k| (edit_distance(&lower, &k.to_ascii_lowercase()), k))
        .filter(|(d, k)| *d <= 2.max(k.len() / 4))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (diagonal + usize::from(ca != *cb)).min(row[j] + 1).min(above + 1);
            diagonal = above;
        }
    }
    row[b.len()]
}

/// Duration fields: a bare number there is a missing unit, not a wrong type.
const DURATION_FIELDS: &[&str] =
    &["per", "maxDelay", "maxStaleness", "reservationTtl", "retryAfter", "retryAfterJitter", "criticalWait"];

/// serde's message for a field of the wrong type, in the words of the YAML the user wrote
/// rather than of the Rust types it is read into (`expected struct PathMatch`, `expected u64`),
/// with the fix where it is clear: a duration written as a bare number needs its unit.
fn in_yaml_terms(message: &str, path: &str) -> String {
    let field = path.rsplit('.').next().unwrap_or(path);
    let field = field.split('[').next().unwrap_or(field);
    let mut out = message.to_string();
    if let Some(start) = out.find("expected struct ") {
        let end = out[start + "expected struct ".len()..]
            .find(|c: char| !c.is_alphanumeric() && c != '_')
            .map_or(out.len(), |n| start + "expected struct ".len() + n);
        let fields = spec_schema()
            .and_then(|schema| schema_at(schema, path))
            .and_then(|s| s.get("properties")?.as_object().map(|p| p.keys().cloned().collect::<Vec<_>>()))
            .filter(|fields| !fields.is_empty())
            .map(|fields| format!(" with fields {}", fields.join(", ")))
            .unwrap_or_default();
        out.replace_range(start..end, &format!("expected a mapping{fields}"));
    }
    // An enum given a mapping or a boolean: serde_yaml names its own internal type
    // (`expected a Value::Tagged enum`); the schema has the words the user can write.
    for rust in ["expected a Value::Tagged enum", "expected enum "] {
        if let Some(start) = out.find(rust) {
            let choices = spec_schema()
                .and_then(|schema| schema_at(schema, path))
                .and_then(|s| s.get("enum")?.as_array().cloned())
                .map(|values| values.iter().filter_map(|v| v.as_str().map(|v| format!("`{v}`"))).collect::<Vec<_>>())
                .filter(|choices| !choices.is_empty());
            let words =
                choices.map_or_else(|| "expected a name".to_string(), |c| format!("expected one of {}", c.join(", ")));
            out.replace_range(start.., &words);
        }
    }
    for (rust, yaml) in [
        ("expected u16", "expected a whole number"),
        ("expected u32", "expected a whole number"),
        ("expected u64", "expected a whole number"),
        ("expected i32", "expected a whole number"),
        ("expected i64", "expected a whole number"),
        ("expected f64", "expected a number"),
        ("expected a sequence", "expected a list"),
        ("expected a boolean", "expected true or false"),
    ] {
        if let Some(rest) = out.strip_suffix(rust) {
            out = format!("{rest}{yaml}");
        }
    }
    let bare_number = out.starts_with("invalid type: integer") || out.starts_with("invalid type: floating point");
    if DURATION_FIELDS.contains(&field) && bare_number && out.ends_with("expected a string") {
        out.push_str(": a duration needs its unit, such as `60s`, `1m` or `500ms`");
    }
    out
}

/// The schema of the value at `path` (`spec.rules[0].match.paths[0]`) under `spec`'s schema.
fn schema_at<'a>(spec: &'a serde_json::Value, path: &str) -> Option<&'a serde_json::Value> {
    let mut schema = spec;
    for segment in path.strip_prefix("spec")?.split('.').filter(|s| !s.is_empty()) {
        let mut parts = segment.split('[');
        let name = parts.next().unwrap_or("");
        if !name.is_empty() {
            schema = schema.get("properties")?.get(name)?;
        }
        for _index in parts {
            schema = schema.get("items")?;
        }
    }
    Some(schema)
}

/// Reads, validates and compiles every policy under `paths`. Any problem fails the whole load,
/// naming the file, the document and the field, so a typo never silently drops a policy. Each
/// policy is validated (and its regexes compiled) once, by the compile.
///
/// `replicas` is the number of enforcers sharing each `localFallback` limit
/// (`--fallback-replicas`), for the layering report ([`super::layering`]).
pub fn load_snapshot(paths: &[PathBuf], replicas: u32) -> Result<Snapshot, String> {
    let (snapshot, warnings) = load_snapshot_with_warnings(paths, replicas)?;
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    Ok(snapshot)
}

/// [`load_snapshot`], and the risky but valid choices of the policies (what the webhook returns
/// as admission warnings), each naming its file, policy and field, followed by the layering
/// report of all of them together.
pub fn load_snapshot_with_warnings(paths: &[PathBuf], replicas: u32) -> Result<(Snapshot, Vec<String>), String> {
    let parsed = parse_paths(paths).map_err(|e: LoadErrors| e.to_string())?;
    let origins: HashMap<String, (PathBuf, usize)> =
        parsed.iter().map(|l| (l.policy.qualified_name(), (l.file.clone(), l.document))).collect();
    let at = |qualified: &str| match origins.get(qualified) {
        Some((file, document)) => format!("{} (document {document}), policy {qualified}", file.display()),
        None => format!("policy {qualified}"),
    };
    let mut warnings: Vec<String> = parsed
        .iter()
        .flat_map(|l| {
            let at = at(&l.policy.qualified_name());
            super::validate::warnings(&l.policy).into_iter().map(move |w| format!("{at}: {w}"))
        })
        .collect();
    let policies: Vec<RateLimitPolicy> = parsed.iter().map(|l| l.policy.clone()).collect();
    warnings.extend(super::layering::report(&policies, replicas).iter().map(|f| {
        format!("{}: spec.rules[{}] ({}): layering: {}: {}", at(&f.policy), f.index, f.rule, f.kind.name(), f.message)
    }));
    let compiled = super::compile(parsed.into_iter().map(|l| l.policy).collect());
    if compiled.rejected.is_empty() {
        return Ok((compiled.snapshot, warnings));
    }
    let errors = compiled
        .rejected
        .into_iter()
        .map(|rejected| {
            let (file, document) = origins.get(&rejected.policy).cloned().unwrap_or_default();
            LoadError::Invalid { file, document, policy: rejected.policy, errors: rejected.errors }
        })
        .collect();
    Err(LoadErrors(errors).to_string())
}
