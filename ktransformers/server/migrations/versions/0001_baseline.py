"""Baseline: the tables as the server created them before its schema was versioned.

A database file from before versioning already holds some or all of them: only the missing ones
are created, so such a file is adopted as revision 0001 and migrated on from there.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _id():
    return sa.Column("id", sa.String(64), nullable=False)


def _seq():
    return sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=True)


TABLES = {
    "assistants": lambda: [
        _seq(), _id(), sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(256), nullable=True), sa.Column("description", sa.Text(), nullable=True),
        sa.Column("model", sa.String(256), nullable=False), sa.Column("instructions", sa.Text(), nullable=True),
        sa.Column("tools", sa.JSON(), nullable=False), sa.Column("tool_resources", sa.JSON(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False), sa.Column("temperature", sa.Float(), nullable=True),
        sa.Column("top_p", sa.Float(), nullable=True), sa.Column("response_format", sa.JSON(), nullable=True)],
    "threads": lambda: [
        _seq(), _id(), sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False), sa.Column("tool_resources", sa.JSON(), nullable=True)],
    "messages": lambda: [
        _seq(), _id(), sa.Column("thread_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False), sa.Column("role", sa.String(16), nullable=False),
        sa.Column("content", sa.JSON(), nullable=False), sa.Column("status", sa.String(16), nullable=False),
        sa.Column("assistant_id", sa.String(64), nullable=True), sa.Column("run_id", sa.String(64), nullable=True),
        sa.Column("attachments", sa.JSON(), nullable=False), sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("completed_at", sa.Integer(), nullable=True), sa.Column("incomplete_at", sa.Integer(), nullable=True),
        sa.Column("incomplete_details", sa.JSON(), nullable=True)],
    "runs": lambda: [
        _seq(), _id(), sa.Column("thread_id", sa.String(64), nullable=False),
        sa.Column("assistant_id", sa.String(64), nullable=False), sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False), sa.Column("model", sa.String(256), nullable=False),
        sa.Column("instructions", sa.Text(), nullable=True), sa.Column("tools", sa.JSON(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False), sa.Column("temperature", sa.Float(), nullable=True),
        sa.Column("top_p", sa.Float(), nullable=True), sa.Column("max_prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("max_completion_tokens", sa.Integer(), nullable=True),
        sa.Column("started_at", sa.Integer(), nullable=True), sa.Column("completed_at", sa.Integer(), nullable=True),
        sa.Column("cancelled_at", sa.Integer(), nullable=True), sa.Column("failed_at", sa.Integer(), nullable=True),
        sa.Column("expires_at", sa.Integer(), nullable=True), sa.Column("last_error", sa.JSON(), nullable=True),
        sa.Column("usage", sa.JSON(), nullable=True), sa.Column("incomplete_details", sa.JSON(), nullable=True),
        sa.Column("message_id", sa.String(64), nullable=True), sa.Column("tool_choice", sa.JSON(), nullable=True),
        sa.Column("truncation_strategy", sa.JSON(), nullable=True),
        sa.Column("response_format", sa.JSON(), nullable=True),
        sa.Column("parallel_tool_calls", sa.Boolean(), nullable=False)],
    "responses": lambda: [
        _seq(), _id(), sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("previous_response_id", sa.String(64), nullable=True),
        sa.Column("conversation_id", sa.String(64), nullable=True),
        sa.Column("data", sa.JSON(), nullable=False), sa.Column("input_items", sa.JSON(), nullable=False)],
    "conversations": lambda: [
        _seq(), _id(), sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False)],
    "conversation_items": lambda: [
        _seq(), _id(), sa.Column("conversation_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False), sa.Column("data", sa.JSON(), nullable=False)],
}
#: the non-unique indexes besides each table's unique ``ix_<table>_id``
INDEXES = {"messages": ["thread_id"], "runs": ["thread_id"], "responses": ["conversation_id"],
           "conversation_items": ["conversation_id"]}


def upgrade() -> None:
    existing = set(sa.inspect(op.get_bind()).get_table_names())
    for table, columns in TABLES.items():
        if table in existing:
            continue
        op.create_table(table, *columns())
        op.create_index(f"ix_{table}_id", table, ["id"], unique=True)
        for col in INDEXES.get(table, []):
            op.create_index(f"ix_{table}_{col}", table, [col])


def downgrade() -> None:
    for table in reversed(list(TABLES)):
        op.drop_table(table)
