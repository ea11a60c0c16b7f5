"""Speculative decoding: proposals (n-gram prompt lookup or a draft model) verified by the target model in
one forward pass with 1 + k query rows per decoding request, accepted by rules that keep the output
distribution exactly the target's."""
