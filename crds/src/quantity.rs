//! Byte counts in Kubernetes quantity notation (`4Gi`, `512M`, `1.5Gi`, `1e9`).
//!
//! Memory in specs and node status is a `Quantity` a person can read; the
//! planner works in bytes. This module converts both ways.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// A quantity that is not a byte count.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not a byte quantity: {why} (write e.g. 512Mi, 4Gi or 1500000000)")]
pub struct QuantityError {
    /// The text that failed to parse.
    pub value: String,
    /// What is wrong with it.
    pub why: &'static str,
}

const SUFFIXES: &[(&str, f64)] = &[
    ("Ki", 1024.0),
    ("Mi", 1048576.0),
    ("Gi", 1073741824.0),
    ("Ti", 1099511627776.0),
    ("Pi", 1125899906842624.0),
    ("Ei", 1152921504606846976.0),
    ("k", 1e3),
    ("M", 1e6),
    ("G", 1e9),
    ("T", 1e12),
    ("P", 1e15),
    ("E", 1e18),
    ("m", 1e-3),
];

/// Parses a quantity as a whole number of bytes (fractions round up).
pub fn parse_bytes(q: &Quantity) -> Result<u64, QuantityError> {
    parse_bytes_str(&q.0)
}

/// Parses quantity text as a whole number of bytes (fractions round up).
pub fn parse_bytes_str(text: &str) -> Result<u64, QuantityError> {
    let err = |why| QuantityError {
        value: text.to_string(),
        why,
    };
    let s = text.trim();
    if s.is_empty() {
        return Err(err("it is empty"));
    }
    if s.starts_with('-') {
        return Err(err("it is negative"));
    }
    let (number, multiplier) = match SUFFIXES.iter().find(|(suffix, _)| s.ends_with(suffix)) {
        Some((suffix, m)) => (&s[..s.len() - suffix.len()], *m),
        None => match s.find(['e', 'E']) {
            Some(i) => {
                let exp: i32 = s[i + 1..]
                    .parse()
                    .map_err(|_| err("its exponent is not a whole number"))?;
                (&s[..i], 10f64.powi(exp))
            }
            None => (s, 1.0),
        },
    };
    let number = number.strip_prefix('+').unwrap_or(number);
    if number.is_empty() || !number.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(err("it is not a number with an optional suffix"));
    }
    let value: f64 = number
        .parse()
        .map_err(|_| err("it is not a number with an optional suffix"))?;
    let bytes = (value * multiplier).ceil();
    if !bytes.is_finite() || bytes > u64::MAX as f64 {
        return Err(err("it is too large"));
    }
    Ok(bytes as u64)
}

/// Formats bytes with the largest binary suffix that divides them exactly.
pub fn format_bytes(bytes: u64) -> Quantity {
    for (suffix, m) in SUFFIXES[..6].iter().rev() {
        let m = *m as u64;
        if bytes >= m && bytes.is_multiple_of(m) {
            return Quantity(format!("{}{}", bytes / m, suffix));
        }
    }
    Quantity(bytes.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_decimal_and_plain_quantities() {
        assert_eq!(parse_bytes_str("4Gi").unwrap(), 4 << 30);
        assert_eq!(parse_bytes_str("512Mi").unwrap(), 512 << 20);
        assert_eq!(parse_bytes_str("1.5Gi").unwrap(), 3 << 29);
        assert_eq!(parse_bytes_str("2G").unwrap(), 2_000_000_000);
        assert_eq!(parse_bytes_str("1500").unwrap(), 1500);
        assert_eq!(parse_bytes_str("1e9").unwrap(), 1_000_000_000);
        assert_eq!(parse_bytes_str("+3k").unwrap(), 3000);
        assert_eq!(parse_bytes_str("1500m").unwrap(), 2, "fractions round up");
    }

    #[test]
    fn rejects_what_is_not_a_byte_count() {
        for bad in ["", "-1Gi", "Gi", "4GB", "four", "1.2.3Mi", "1e", "1e999"] {
            let e = parse_bytes_str(bad).unwrap_err();
            assert!(e.to_string().contains("not a byte quantity"), "{bad}: {e}");
        }
    }

    #[test]
    fn formats_with_the_largest_exact_suffix() {
        assert_eq!(format_bytes(4 << 30).0, "4Gi");
        assert_eq!(format_bytes(1536 << 20).0, "1536Mi");
        assert_eq!(format_bytes(1000).0, "1000");
        assert_eq!(format_bytes(0).0, "0");
        for b in [0u64, 1, 1024, 3 << 29, 123_456_789] {
            assert_eq!(parse_bytes(&format_bytes(b)).unwrap(), b);
        }
    }
}
