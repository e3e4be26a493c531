"""kvloop's benchmarks and workloads (``kvloop bench broker|engines|multiturn``) and the synchronous P/D turn
driver the engine tests use. Top floor: they may import anything; production code never imports them."""
