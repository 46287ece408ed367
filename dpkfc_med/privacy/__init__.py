"""Scale-then-privatize DP optimizer on Opacus, privacy engine, units, accountants and the privacy ledger."""
