//! Responses as policies read them: the cost a response reports about itself (`usage`), read
//! by the sidecar as the body streams past and validated where a policy declares it. The
//! counterpart of `request/`, and as pure: bytes in, a cost or a named problem out.

pub mod usage;
