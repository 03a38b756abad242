//! Calendar arithmetic for the RFC 3339 UTC times Kubernetes and gpushare print, with no
//! calendar crate and no clock: days to civil dates and back (Howard Hinnant's algorithms),
//! formatting a Unix time, and parsing RFC 3339 with fractions and offsets. The CLI, the
//! API-server stand-in and its printed tables share these.

/// The civil date (year, month 1–12, day 1–31) of a day counted from 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
#[must_use]
pub fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The day counted from 1970-01-01 of a civil date (`days_from_civil`, the inverse).
#[must_use]
pub fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Days in a month of a year (leap years included).
#[must_use]
pub fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// A Unix time in ms as RFC 3339 UTC to the second: `0` is `1970-01-01T00:00:00Z`. Any `i64`
/// formats (negative times count back from 1970).
#[must_use]
pub fn format_ms(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (year, month, day) = civil_from_days(secs.div_euclid(86_400));
    let s = secs.rem_euclid(86_400);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", s / 3600, s % 3600 / 60, s % 60)
}

/// `YYYY-MM-DD(T|t| )HH:MM:SS[.fraction](Z|z|+HH:MM|-HH:MM)` as Unix ms, or `None`.
#[must_use]
pub fn parse_rfc3339(s: &str) -> Option<i64> {
    let digits = |from: usize, len: usize| -> Option<i64> {
        let part = s.get(from..from + len)?;
        if part.bytes().all(|b| b.is_ascii_digit()) { part.parse().ok() } else { None }
    };
    let at = |i: usize, allowed: &[u8]| s.as_bytes().get(i).is_some_and(|b| allowed.contains(b));
    if !(at(4, b"-") && at(7, b"-") && at(10, b"Tt ") && at(13, b":") && at(16, b":")) {
        return None;
    }
    let (year, month, day) = (digits(0, 4)?, digits(5, 2)?, digits(8, 2)?);
    let (hour, minute, second) = (digits(11, 2)?, digits(14, 2)?, digits(17, 2)?);
    let mut rest = s.get(19..)?;
    let mut millis = 0;
    if let Some(fraction) = rest.strip_prefix('.') {
        let n = fraction.bytes().take_while(u8::is_ascii_digit).count();
        if n == 0 {
            return None;
        }
        for (i, b) in fraction.bytes().take(3).enumerate() {
            if i < n {
                millis = millis * 10 + i64::from(b - b'0');
            }
        }
        for _ in n..3 {
            millis *= 10;
        }
        rest = fraction.get(n..)?;
    }
    let offset_minutes = match rest {
        "Z" | "z" => 0,
        _ => {
            let sign = match rest.as_bytes().first() {
                Some(b'+') => 1,
                Some(b'-') => -1,
                _ => return None,
            };
            let o = rest.get(1..)?;
            let b = o.as_bytes();
            if b.len() != 5 || b.get(2) != Some(&b':') {
                return None;
            }
            let hh: i64 = o.get(0..2).filter(|p| p.bytes().all(|c| c.is_ascii_digit()))?.parse().ok()?;
            let mm: i64 = o.get(3..5).filter(|p| p.bytes().all(|c| c.is_ascii_digit()))?.parse().ok()?;
            if hh > 23 || mm > 59 {
                return None;
            }
            sign * (hh * 60 + mm)
        }
    };
    if !(1..=12).contains(&month)
        || !(1..=days_in_month(year, month)).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let secs = days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second - offset_minutes * 60;
    Some(secs * 1000 + millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_days_round_trip() {
        for days in (-800_000..800_000).step_by(997) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    #[test]
    fn formats_and_parses_back() {
        for ms in [0, 951_782_400_000, 1_763_892_000_000, 4_107_542_399_000, -86_400_000] {
            assert_eq!(parse_rfc3339(&format_ms(ms)), Some(ms));
        }
        assert_eq!(days_in_month(2000, 2), 29);
        assert_eq!(days_in_month(1900, 2), 28);
        assert_eq!(parse_rfc3339("2026-02-30T00:00:00Z"), None);
    }
}
