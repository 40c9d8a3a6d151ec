//! The bearer token of mutating endpoints, compared in constant time.

use axum::http::{header, HeaderMap};
use postbox_core::redact::Secret;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Why a mutating call was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No `admin.token` configured: mutating calls are disabled.
    NoTokenConfigured,
    /// Missing or wrong `Authorization: Bearer …`.
    BadToken,
}

/// The configured token, stored as its SHA-256 so that the comparison
/// runs over equal lengths and leaks nothing about the token's length.
#[derive(Clone)]
pub(crate) struct TokenCheck {
    digest: Option<[u8; 32]>,
}

impl TokenCheck {
    pub(crate) fn new(token: Option<&Secret>) -> Self {
        TokenCheck {
            digest: token
                .filter(|t| !t.is_empty())
                .map(|t| Sha256::digest(t.expose().as_bytes()).into()),
        }
    }

    /// Checks the request's `Authorization` header.
    pub(crate) fn check(&self, headers: &HeaderMap) -> Result<(), Refusal> {
        let Some(expected) = &self.digest else {
            return Err(Refusal::NoTokenConfigured);
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or(Refusal::BadToken)?;
        let given: [u8; 32] = Sha256::digest(given.as_bytes()).into();
        if bool::from(given.ct_eq(expected)) {
            Ok(())
        } else {
            Err(Refusal::BadToken)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, auth.parse().unwrap());
        h
    }

    #[test]
    fn only_the_configured_token_passes() {
        let check = TokenCheck::new(Some(&Secret::new("s3cret")));
        assert_eq!(check.check(&headers("Bearer s3cret")), Ok(()));
        assert_eq!(
            check.check(&headers("Bearer s3cre")),
            Err(Refusal::BadToken)
        );
        assert_eq!(check.check(&headers("s3cret")), Err(Refusal::BadToken));
        assert_eq!(check.check(&HeaderMap::new()), Err(Refusal::BadToken));
    }

    #[test]
    fn no_token_configured_refuses_everything() {
        for t in [None, Some(Secret::new(""))] {
            let check = TokenCheck::new(t.as_ref());
            assert_eq!(
                check.check(&headers("Bearer ")),
                Err(Refusal::NoTokenConfigured)
            );
        }
    }
}
