//! postbox consumers (issue 4).
