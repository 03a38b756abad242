//! Memory units: the [`Mib`] newtype with checked arithmetic, the cluster-wide [`MemoryUnit`]
//! (MiB or GiB) that device counts are expressed in, and the parser for Kubernetes quantity
//! strings (`"3500"`, `"4k"`, `"4Gi"`, `"1e3"`) as they appear in pod specs.
//!
//! Everything inside gpushare is counted in MiB. The cluster unit only matters at the edges:
//! a pod's request is read in units, and a GPU's schedulable capacity is its total rounded down
//! to whole units, because the daemon advertises one kubelet device per unit.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// An amount of GPU memory in mebibytes. The inner value is private; arithmetic is checked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Mib(u64);

impl Mib {
    /// No memory.
    pub const ZERO: Mib = Mib(0);

    /// `value` MiB.
    #[must_use]
    pub const fn new(value: u64) -> Self {
        Mib(value)
    }

    /// The amount as a plain number of MiB.
    #[must_use]
    pub const fn get(self) -> u64 {
        self.0
    }

    /// `self + other`, or `None` on overflow.
    #[must_use]
    pub const fn checked_add(self, other: Mib) -> Option<Mib> {
        match self.0.checked_add(other.0) {
            Some(v) => Some(Mib(v)),
            None => None,
        }
    }

    /// `self - other`, or `None` if `other` is larger.
    #[must_use]
    pub const fn checked_sub(self, other: Mib) -> Option<Mib> {
        match self.0.checked_sub(other.0) {
            Some(v) => Some(Mib(v)),
            None => None,
        }
    }

    /// `self - other`, or zero if `other` is larger.
    #[must_use]
    pub const fn saturating_sub(self, other: Mib) -> Mib {
        Mib(self.0.saturating_sub(other.0))
    }

    /// `self + other`, clamped at the largest value.
    #[must_use]
    pub const fn saturating_add(self, other: Mib) -> Mib {
        Mib(self.0.saturating_add(other.0))
    }

    /// `self * factor`, or `None` on overflow.
    #[must_use]
    pub const fn checked_mul(self, factor: u64) -> Option<Mib> {
        match self.0.checked_mul(factor) {
            Some(v) => Some(Mib(v)),
            None => None,
        }
    }

    /// `self / parts` when it divides exactly, otherwise `None` (also for `parts == 0`).
    #[must_use]
    pub const fn div_exact(self, parts: u64) -> Option<Mib> {
        if parts == 0 || !self.0.is_multiple_of(parts) { None } else { Some(Mib(self.0 / parts)) }
    }

    /// The larger of two amounts.
    #[must_use]
    pub fn max(self, other: Mib) -> Mib {
        Ord::max(self, other)
    }
}

impl fmt::Display for Mib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} MiB", self.0)
    }
}

impl std::iter::Sum for Mib {
    /// Saturating sum: callers that must detect overflow use [`Mib::checked_add`].
    fn sum<I: Iterator<Item = Mib>>(iter: I) -> Mib {
        iter.fold(Mib::ZERO, Mib::saturating_add)
    }
}

/// The unit one kubelet device stands for, set once for the whole cluster.
///
/// MiB is the default and the precise choice. GiB exists for clusters moving over from
/// Alibaba's gpushare, whose default it is; with GiB a GPU's capacity is its total rounded
/// down to whole GiB (a 16 276 MiB card offers 15 GiB).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemoryUnit {
    /// One device per mebibyte.
    #[default]
    #[serde(rename = "MiB")]
    Mib,
    /// One device per gibibyte.
    #[serde(rename = "GiB")]
    Gib,
}

impl MemoryUnit {
    /// How many MiB one unit is.
    #[must_use]
    pub const fn mib_per_unit(self) -> u64 {
        match self {
            MemoryUnit::Mib => 1,
            MemoryUnit::Gib => 1024,
        }
    }

    /// `units` of this unit in MiB, or `None` on overflow.
    #[must_use]
    pub const fn to_mib(self, units: u64) -> Option<Mib> {
        Mib::new(units).checked_mul(self.mib_per_unit())
    }

    /// How many whole units fit in `amount` (rounded down).
    #[must_use]
    pub const fn whole_units(self, amount: Mib) -> u64 {
        amount.get() / self.mib_per_unit()
    }

    /// `amount` rounded down to whole units: the part of a GPU that can be handed out.
    #[must_use]
    pub const fn round_down(self, amount: Mib) -> Mib {
        Mib::new(self.whole_units(amount) * self.mib_per_unit())
    }

    /// The unit's name as it is written in configs and annotations: `MiB` or `GiB`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            MemoryUnit::Mib => "MiB",
            MemoryUnit::Gib => "GiB",
        }
    }
}

impl fmt::Display for MemoryUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A memory unit name that is neither `MiB` nor `GiB`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown memory unit {0:?}: write \"MiB\" or \"GiB\"")]
pub struct UnknownUnit(pub String);

impl FromStr for MemoryUnit {
    type Err = UnknownUnit;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "MiB" | "mib" | "Mib" => Ok(MemoryUnit::Mib),
            "GiB" | "gib" | "Gib" => Ok(MemoryUnit::Gib),
            other => Err(UnknownUnit(other.to_owned())),
        }
    }
}

/// Why a Kubernetes quantity string is not a whole, non-negative count.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum QuantityError {
    /// Nothing was written.
    #[error("the quantity is empty")]
    Empty,
    /// The text is not a Kubernetes quantity at all.
    #[error("{0:?} is not a Kubernetes quantity (expected a whole number such as \"3500\")")]
    Malformed(String),
    /// The value is below zero.
    #[error("{0:?} is negative")]
    Negative(String),
    /// The value has a fractional part (`"1.5"`, `"500m"`).
    #[error("{0:?} is not a whole number")]
    Fractional(String),
    /// The value does not fit in 64 bits.
    #[error("{0:?} is too large")]
    TooLarge(String),
}

/// A parsed quantity: its whole value and whether it was written with a binary suffix
/// (`Ki`, `Mi`, `Gi`, …), which for GPU memory is nearly always a mistake (see
/// [`crate::request`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantity {
    /// The value as a plain count.
    pub value: u64,
    /// True for `Ki`, `Mi`, `Gi`, `Ti`, `Pi`, `Ei`.
    pub binary_suffix: bool,
}

/// Parses a Kubernetes quantity that must be a whole, non-negative number.
///
/// Accepts every form the API server may hand back for an extended resource: plain digits,
/// decimal SI suffixes (the API server writes `4000` as `"4k"`), binary SI suffixes and
/// decimal exponents (`"4e3"`). Fractions, negatives and values above `u64::MAX` are errors.
///
/// # Errors
/// A [`QuantityError`] saying what is wrong with `text`.
pub fn parse_quantity(text: &str) -> Result<Quantity, QuantityError> {
    let s = text.trim();
    if s.is_empty() {
        return Err(QuantityError::Empty);
    }
    let malformed = || QuantityError::Malformed(text.to_owned());
    let (negative, body) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let number_end = body.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(body.len());
    let (number, suffix) = body.split_at(number_end);
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    if int_part.is_empty() && frac_part.is_empty() {
        return Err(malformed());
    }
    if frac_part.contains('.') {
        return Err(malformed());
    }

    // value = digits * 10^dec_exp * 2^bin_exp, digits = int_part ++ frac_part.
    let mut dec_exp: i64 = -i64::try_from(frac_part.len()).map_err(|_| malformed())?;
    let mut bin_exp: u32 = 0;
    let binary_suffix;
    match suffix {
        "" => binary_suffix = false,
        "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" => {
            binary_suffix = true;
            bin_exp = match suffix {
                "Ki" => 10,
                "Mi" => 20,
                "Gi" => 30,
                "Ti" => 40,
                "Pi" => 50,
                _ => 60,
            };
        }
        "n" | "u" | "m" | "k" | "M" | "G" | "T" | "P" | "E" => {
            binary_suffix = false;
            dec_exp += match suffix {
                "n" => -9,
                "u" => -6,
                "m" => -3,
                "k" => 3,
                "M" => 6,
                "G" => 9,
                "T" => 12,
                "P" => 15,
                _ => 18,
            };
        }
        exp if exp.starts_with(['e', 'E']) => {
            binary_suffix = false;
            let digits = &exp[1..];
            let unsigned = digits.strip_prefix(['+', '-']).unwrap_or(digits);
            if unsigned.is_empty() || !unsigned.bytes().all(|b| b.is_ascii_digit()) {
                return Err(malformed());
            }
            let e: i64 = digits.parse().map_err(|_| QuantityError::TooLarge(text.to_owned()))?;
            dec_exp = dec_exp.checked_add(e).ok_or_else(|| QuantityError::TooLarge(text.to_owned()))?;
        }
        _ => return Err(malformed()),
    }

    let digits = format!("{int_part}{frac_part}");
    let digits = digits.trim_start_matches('0');
    let is_zero = digits.trim_end_matches('0').is_empty();
    if is_zero {
        return Ok(Quantity { value: 0, binary_suffix });
    }
    if negative {
        return Err(QuantityError::Negative(text.to_owned()));
    }
    // Strip trailing zeros into the exponent so that "1500m" = 15 * 10^1 * 10^-3 is exact.
    let trimmed = digits.trim_end_matches('0');
    dec_exp += i64::try_from(digits.len() - trimmed.len()).map_err(|_| malformed())?;
    if dec_exp < 0 {
        return Err(QuantityError::Fractional(text.to_owned()));
    }
    let too_large = || QuantityError::TooLarge(text.to_owned());
    if trimmed.len() > 20 {
        return Err(too_large());
    }
    let mut value: u128 = trimmed.parse().map_err(|_| too_large())?;
    for _ in 0..dec_exp {
        value = value.checked_mul(10).ok_or_else(too_large)?;
        if value > u128::from(u64::MAX) {
            return Err(too_large());
        }
    }
    value = value.checked_shl(bin_exp).ok_or_else(too_large)?;
    let value = u64::try_from(value).map_err(|_| too_large())?;
    Ok(Quantity { value, binary_suffix })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mib_arithmetic_is_checked() {
        assert_eq!(Mib::new(2).checked_add(Mib::new(3)), Some(Mib::new(5)));
        assert_eq!(Mib::new(u64::MAX).checked_add(Mib::new(1)), None);
        assert_eq!(Mib::new(2).checked_sub(Mib::new(3)), None);
        assert_eq!(Mib::new(2).saturating_sub(Mib::new(3)), Mib::ZERO);
        assert_eq!(Mib::new(u64::MAX).checked_mul(2), None);
        assert_eq!(Mib::new(3000).div_exact(2), Some(Mib::new(1500)));
        assert_eq!(Mib::new(3001).div_exact(2), None);
        assert_eq!(Mib::new(3000).div_exact(0), None);
        assert_eq!(Mib::new(3500).to_string(), "3500 MiB");
    }

    #[test]
    fn units_round_capacity_down() {
        assert_eq!(MemoryUnit::Gib.round_down(Mib::new(16_276)), Mib::new(15 * 1024));
        assert_eq!(MemoryUnit::Gib.whole_units(Mib::new(16_276)), 15);
        assert_eq!(MemoryUnit::Mib.round_down(Mib::new(16_276)), Mib::new(16_276));
        assert_eq!(MemoryUnit::Gib.to_mib(4), Some(Mib::new(4096)));
        assert_eq!(MemoryUnit::Gib.to_mib(u64::MAX), None);
        assert_eq!("GiB".parse::<MemoryUnit>(), Ok(MemoryUnit::Gib));
        assert!("GB".parse::<MemoryUnit>().is_err());
    }

    #[test]
    fn quantities_that_are_whole_counts() {
        for (text, value) in [
            ("3500", 3500),
            ("+3500", 3500),
            (" 7 ", 7),
            ("0", 0),
            ("-0", 0),
            ("4k", 4000),
            ("16M", 16_000_000),
            ("4e3", 4000),
            ("4E3", 4000),
            ("1.5k", 1500),
            ("2000m", 2),
            ("2000000u", 2),
            ("350e-1", 35),
        ] {
            let q = parse_quantity(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(q.value, value, "{text}");
            assert!(!q.binary_suffix, "{text}");
        }
        let q = parse_quantity("4Gi").unwrap();
        assert_eq!(q.value, 4 << 30);
        assert!(q.binary_suffix);
        assert_eq!(parse_quantity("1Ki").unwrap().value, 1024);
        assert_eq!(parse_quantity("18446744073709551615").unwrap().value, u64::MAX);
    }

    #[test]
    fn quantities_that_are_refused() {
        for (text, want) in [
            ("", QuantityError::Empty),
            ("  ", QuantityError::Empty),
            ("abc", QuantityError::Malformed("abc".into())),
            ("12GB", QuantityError::Malformed("12GB".into())),
            ("1.2.3", QuantityError::Malformed("1.2.3".into())),
            (".", QuantityError::Malformed(".".into())),
            ("e3", QuantityError::Malformed("e3".into())),
            ("4e", QuantityError::Malformed("4e".into())),
            ("4e+", QuantityError::Malformed("4e+".into())),
            ("-5", QuantityError::Negative("-5".into())),
            ("1.5", QuantityError::Fractional("1.5".into())),
            ("500m", QuantityError::Fractional("500m".into())),
            ("35e-1", QuantityError::Fractional("35e-1".into())),
            ("18446744073709551616", QuantityError::TooLarge("18446744073709551616".into())),
            ("20E", QuantityError::TooLarge("20E".into())),
            ("16Ei", QuantityError::TooLarge("16Ei".into())),
            ("1e999999999999999999999", QuantityError::TooLarge("1e999999999999999999999".into())),
        ] {
            assert_eq!(parse_quantity(text), Err(want), "{text:?}");
        }
    }
}
