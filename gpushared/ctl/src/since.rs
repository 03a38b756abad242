//! The times `--since` accepts.

use gpushare_core::time::parse_rfc3339;

const SINCE_FORMS: &str = "write an RFC 3339 time (2026-11-23T10:00:00Z), a Unix time in ms (1763892000000), or a duration ago (30s, 10m, 2h, 1d)";

/// The Unix ms `--since` means, `now_ms` being now: an RFC 3339 time (`2026-11-23T10:00:00Z`,
/// with optional fractional seconds and a `Z` or `±HH:MM` offset), a Unix time in ms (all
/// digits), or a duration ago (`30s`, `10m`, `2h`, `1d`).
///
/// # Errors
///
/// A message naming the input and the forms accepted.
pub fn parse_since(s: &str, now_ms: i64) -> Result<i64, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err(format!("an empty time; {SINCE_FORMS}"));
    }
    if t.bytes().all(|b| b.is_ascii_digit()) {
        return t.parse::<i64>().map_err(|_| format!("{t} is too large for a Unix time in ms"));
    }
    let per = match t.chars().last() {
        Some('s') => 1000,
        Some('m') => 60_000,
        Some('h') => 3_600_000,
        Some('d') => 86_400_000,
        _ => 0,
    };
    if let Some(digits) = t.get(..t.len() - 1)
        && per > 0
        && !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
    {
        return digits
            .parse::<i64>()
            .ok()
            .and_then(|n| n.checked_mul(per))
            .and_then(|ago| now_ms.checked_sub(ago))
            .ok_or_else(|| format!("{t} is too long ago"));
    }
    if t.len() >= 5 && t.as_bytes().get(4) == Some(&b'-') && t.bytes().take(4).all(|b| b.is_ascii_digit()) {
        return parse_rfc3339(t).ok_or_else(|| {
            format!("{t:?} is not an RFC 3339 time or has no such date or time; write one such as 2026-11-23T10:00:00Z")
        });
    }
    Err(format!("{t:?} is not a time; {SINCE_FORMS}"))
}
