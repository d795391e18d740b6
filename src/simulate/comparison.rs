//! What `--compare` found, per rule and algorithm, and its table for a terminal: the report's
//! part that both the replay's report and the comparison itself name.

use serde::Serialize;

#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Comparison {
    pub policy: String,
    pub rule: String,
    pub rows: Vec<CompareRow>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CompareRow {
    pub algorithm: &'static str,
    pub offered: u64,
    pub admitted: u64,
    pub denied: u64,
    pub max_admitted_in_any_window: u64,
    pub bound: Option<u64>,
    pub bound_formula: &'static str,
    /// Why this algorithm could not run this rule (e.g. slidingWindowLog above 1000 requests).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// The comparison as printed after the replay's own table.
pub fn to_text(comparisons: &[Comparison]) -> String {
    use std::fmt::Write as _;
    let mut out = String::from(
        "\nthe same traffic through each algorithm (same requests and per; burst, maxDelay where they apply):\n",
    );
    for c in comparisons {
        let _ = writeln!(out, "{}/{}:", c.policy, c.rule);
        let _ = writeln!(
            out,
            "  {:<20} {:>9} {:>9} {:>9} {:>11} {:>7}  bound means",
            "algorithm", "offered", "admitted", "denied", "maxInWindow", "bound"
        );
        for r in &c.rows {
            match &r.skipped {
                Some(why) => {
                    let _ = writeln!(out, "  {:<20} skipped: {why}", r.algorithm);
                }
                None => {
                    let _ = writeln!(
                        out,
                        "  {:<20} {:>9} {:>9} {:>9} {:>11} {:>7}  {}",
                        r.algorithm,
                        r.offered,
                        r.admitted,
                        r.denied,
                        r.max_admitted_in_any_window,
                        r.bound.map_or_else(|| "-".to_string(), |b| b.to_string()),
                        r.bound_formula
                    );
                }
            }
        }
    }
    out
}
