//! Persistent fingerprint index (see ARCHITECTURE.md, "Fingerprint index").
