//! postbox admin API, metrics and dashboard (issue 5).
