"""Who may review learned diagnosis rules, decided by PostgreSQL (issue 29, items 1 and 11).

On PostgreSQL `diagnosis_rules` gets row-level security (forced, so its owner obeys it too):

- every role reads every rule (diagnoses use them);
- an operator (a member of FORGEFLOW_OPERATOR_ROLE, `forgeflow_is_operator()` of 0008) inserts,
  changes and deletes any rule: approving or rejecting a learned rule (`forgeflow rules approve|
  reject`), editing or deleting one, and adding one by hand (for every job or a family);
- any other role inserts only a *proposed* rule (review `proposed`, scope `family`, not
  reviewed) for a job family it has a job of that it may change (`forgeflow_may_change_job`):
  a flow's failure agent learning from its own job. It changes and deletes no rule: its UPDATE
  or DELETE touches no row.

The table keeps the privileges 0008 granted to PUBLIC (the rule writers' `LOCK TABLE ... SHARE
ROW EXCLUSIVE` needs UPDATE); the policies decide which rows. SQLite is single-user: every
process is trusted and may review rules.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

POLICIES = ("diagnosis_rules_read", "diagnosis_rules_operator", "diagnosis_rules_propose")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    run = op.execute
    schema = op.get_bind().exec_driver_sql("SELECT current_schema()").scalar()
    s = f'"{schema}"'
    # a family a role may propose for: the name of a job it may change (the flow's own job)
    run(f"CREATE OR REPLACE FUNCTION {s}.forgeflow_may_propose_for(family text) RETURNS boolean LANGUAGE sql "
        f"STABLE AS $$ SELECT EXISTS (SELECT 1 FROM {s}.jobs j WHERE j.name = family "
        f"AND {s}.forgeflow_may_change_job(j.submitted_by, j.team)) $$")
    run("ALTER TABLE diagnosis_rules ENABLE ROW LEVEL SECURITY")
    run("ALTER TABLE diagnosis_rules FORCE ROW LEVEL SECURITY")
    operator_only = "((SELECT forgeflow_is_operator()))"
    run("CREATE POLICY diagnosis_rules_read ON diagnosis_rules FOR SELECT USING (true)")
    run(f"CREATE POLICY diagnosis_rules_operator ON diagnosis_rules FOR ALL USING {operator_only} "
        f"WITH CHECK {operator_only}")
    run("CREATE POLICY diagnosis_rules_propose ON diagnosis_rules FOR INSERT WITH CHECK ("
        "review = 'proposed' AND scope = 'family' AND reviewed_by IS NULL AND reviewed_at IS NULL "
        "AND job_family IS NOT NULL AND forgeflow_may_propose_for(job_family))")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for name in POLICIES:
        op.execute(f"DROP POLICY IF EXISTS {name} ON diagnosis_rules")
    op.execute("ALTER TABLE diagnosis_rules NO FORCE ROW LEVEL SECURITY")
    op.execute("ALTER TABLE diagnosis_rules DISABLE ROW LEVEL SECURITY")
    op.execute("DROP FUNCTION IF EXISTS forgeflow_may_propose_for(text)")
