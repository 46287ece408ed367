"""Scale-then-privatize DP optimizer on Opacus, engine, privacy units, accountants, ledger."""
