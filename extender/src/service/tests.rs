//! Tests of the verbs.
